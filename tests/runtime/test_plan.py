"""runtime/plan.py: the device plan both composition roots read. The engine's start-up
(setup.py) and the AOT compile for an absent target (aot.py) take their buckets, KV dtype,
attention backend and max_model_len from plan_device, so the AOT compile proves the
programs a server on that target would run."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxcb import LLM
from jaxcb.config import EngineConfig
from jaxcb.models import registry
from jaxcb.runtime import aot, setup
from jaxcb.runtime.plan import plan_device

ROOT = Path(__file__).resolve().parents[2]
PRESETS = {  # preset -> (the model it is for, the platform it runs on)
    "llama3-8b-h100.yaml": ("configs/models/llama3-8b/config.json", "gpu"),
    "qwen3-8b-v5e-4.yaml": ("configs/models/qwen3-8b/config.json", "tpu"),
}


def preset(name: str) -> tuple[EngineConfig, registry.ModelSpec, str]:
    model, platform = PRESETS[name]
    config = EngineConfig.from_yaml(ROOT / "configs" / name, model=str(ROOT / model))
    return config, registry.spec_from_hf_config(aot.read_model_config(config.model)), platform


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_plan_their_buckets_and_pages(name):
    config, spec, platform = preset(name)
    plan = plan_device(config, spec, platform)
    sched = config.scheduler
    assert plan.max_model_len == config.max_model_len
    assert plan.attention.name.startswith("pallas")
    assert max(b.num_tokens for b in plan.buckets) == sched.max_num_batched_tokens
    assert max(b.num_seqs for b in plan.buckets) == sched.max_num_seqs
    assert plan.pages_per_seq * config.cache.page_size >= plan.max_model_len


def test_default_buckets_start_at_one_token_on_cpu_and_sixteen_elsewhere():
    """On CPU a single stream is not sixteen rows (XLA's dots compute padding rows; with the
    native kernels the LM head's logits and sampling still pass over them)."""
    config, spec, _ = preset("llama3-8b-h100.yaml")
    config = config.replace(token_buckets=None)
    assert min(b.num_tokens for b in plan_device(config, spec, "cpu").buckets) == 1
    for platform in ("gpu", "tpu"):
        assert min(b.num_tokens for b in plan_device(config, spec, platform).buckets) == 16


def test_a_max_model_len_past_the_model_is_one_line():
    config, spec, platform = preset("llama3-8b-h100.yaml")
    with pytest.raises(ValueError, match="larger than the model's max_position_embeddings"):
        plan_device(config.replace(max_model_len=10**7), spec, platform)


class Planned(Exception):
    pass


@pytest.fixture
def spy(monkeypatch):
    """Every plan_device call of setup.py and aot.py, recorded."""
    calls = []

    def record(module, stop):
        real = module.plan_device

        def planned(config, spec, platform):
            plan = real(config, spec, platform)
            calls.append((module.__name__, plan))
            if stop:
                raise Planned
            return plan

        monkeypatch.setattr(module, "plan_device", planned)

    record(setup, stop=False)
    record(aot, stop=True)  # (the compile itself is other tests' business)
    return calls


def test_setup_and_aot_take_their_plan_from_plan_device(spy):
    llm = LLM(
        token_buckets=[16],
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=128,
        num_pages=32,
    )
    ((where, plan),) = spy
    assert where == "jaxcb.runtime.setup" and plan.platform == "cpu"
    assert llm.engine.info.buckets == plan.buckets
    assert llm.engine.info.kv_cache_dtype == str(plan.kv_dtype)

    config, spec, _ = preset("llama3-8b-h100.yaml")
    with pytest.raises(Planned):
        aot.compile_for_target(config, aot.get_target("h100"))
    where, plan = spy[-1]
    assert where == "jaxcb.runtime.aot" and plan.platform == "gpu"
    assert plan.buckets == plan_device(config, spec, "gpu").buckets
