"""EngineConfig: YAML presets, flat overrides, validation (always ValueError), round trips."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcb.config import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LimitsConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    flat_fields,
)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
FLAT_NAMES = sorted(flat_fields())


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# ---- loading ----------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = EngineConfig()
    assert cfg.cache == CacheConfig() and cfg.scheduler == SchedulerConfig()
    assert cfg.kernels == KernelConfig() and cfg.model is None and cfg.dtype == "float32"
    assert EngineConfig.from_dict(None) == EngineConfig.from_dict({}) == cfg


def test_from_yaml_nested(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
model: null
dtype: bfloat16
max_model_len: 256
cache: {page_size: 8, num_pages: 64}
scheduler:
  max_num_seqs: 4
  max_num_batched_tokens: 32
  token_buckets: [8, 16, 32]
kernels: {attention: xla}
""",
    )
    cfg = EngineConfig.from_yaml(path)
    assert cfg.dtype == "bfloat16" and cfg.max_model_len == 256
    assert cfg.cache == CacheConfig(page_size=8, num_pages=64)
    assert cfg.scheduler == SchedulerConfig(4, 32, (8, 16, 32))
    assert cfg.kernels.attention == "xla"
    # Flat keywords override the file; the rest of the file stays.
    cfg = EngineConfig.from_yaml(path, page_size=4, max_num_seqs=2, attention="pallas")
    assert (cfg.cache.page_size, cfg.cache.num_pages) == (4, 64)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (2, 32)
    assert cfg.kernels.attention == "pallas" and cfg.dtype == "bfloat16"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_presets_load(path: Path) -> None:
    cfg = EngineConfig.from_yaml(path)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("text", ["", "# nothing\n", "cache: null\n"])
def test_empty_yaml_gives_defaults(tmp_path: Path, text: str) -> None:
    assert EngineConfig.from_yaml(write(tmp_path, text)) == EngineConfig()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[1, 2]\n", "must hold a mapping"),
        ("cache: {page_size: [\n", "not valid YAML"),
        ("cache: 5\n", "'cache' in config must be a mapping"),
        (
            "cache: {pagesize: 8}\n",
            r"unknown key 'pagesize' in cache; valid keys: \['enable_prefix_caching', 'kv_cache",
        ),
        ("page_size: 8\n", r"unknown key 'page_size' in config; valid keys: \['cache'"),
        ("dtype: float64\n", r"dtype must be one of \['float32', 'bfloat16', 'float16'\]"),
        (
            "kernels: {attention: triton}\n",
            r"attention must be one of \['auto', 'native', 'xla', 'pallas', 'pallas-tpu', "
            r"'pallas-gpu'\]",
        ),
        ("cache: {page_size: eight}\n", "cache.page_size must be an integer, got 'eight'"),
        ("cache: {page_size: 0}\n", "page_size must be >= 1, got 0"),
        ("scheduler: {max_num_seqs: 1.5}\n", "scheduler.max_num_seqs must be an integer"),
        ("max_model_len: true\n", "max_model_len must be an integer, got True"),
        ("seed: null\n", "seed must be an integer, got None"),
        ("model: 3\n", "model must be a string, got 3"),
        ("cache: {memory_utilization: 1.5}\n", r"memory_utilization must be in \(0, 1\]"),
        ("cache: {kv_cache_memory_gb: .inf}\n", "kv_cache_memory_gb must be a finite number"),
        ("cache: {memory_utilization: .nan}\n", "memory_utilization must be"),
        ("cache: {num_pages: 4, kv_cache_memory_gb: 1}\n", "not both"),
    ],
)
def test_bad_yaml_is_a_value_error(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_yaml(write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        EngineConfig.from_yaml(tmp_path / "nope.yaml")


# ---- flat overrides ---------------------------------------------------------------------


def test_flat_overrides_reach_every_section() -> None:
    cfg = EngineConfig.from_dict(
        None,
        page_size=8,
        num_pages=48,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=512,
        dtype="bfloat16",
        attention="pallas",
        seed=7,
        model="/some/dir",
    )
    assert (cfg.cache.page_size, cfg.cache.num_pages) == (8, 48)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (8, 64)
    assert (cfg.max_model_len, cfg.dtype, cfg.kernels.attention) == (512, "bfloat16", "pallas")
    assert (cfg.seed, cfg.model) == (7, "/some/dir")


def test_scheduling_cache_and_limit_fields() -> None:
    cfg = EngineConfig()
    assert cfg.cache.enable_prefix_caching is True
    assert (cfg.scheduler.scheduling_policy, cfg.scheduler.long_prefill_token_threshold) == (
        "fcfs",
        0,
    )
    assert cfg.limits == LimitsConfig(1024, None, 128, None)
    cfg = EngineConfig.from_dict(
        {"limits": {"max_n": 4}},
        enable_prefix_caching="false",
        scheduling_policy="srpf",
        max_output_tokens="32",
        watermark=3,
    )
    assert cfg.cache.enable_prefix_caching is False and cfg.limits.max_n == 4
    assert cfg.scheduler.scheduling_policy == "srpf" and cfg.limits.max_output_tokens == 32
    assert cfg.scheduler.watermark_pages(1000) == 3
    assert EngineConfig().scheduler.watermark_pages(1000) == 10  # 1% of the pool


def test_flat_names_are_unique_and_complete() -> None:
    sections = {
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "kernels": KernelConfig,
        "limits": LimitsConfig,
        "parallel": ParallelConfig,
        "speculative_config": SpeculativeConfig,
        "lora": LoraConfig,
    }
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in sections]
    top = set(names)
    shadowed = []  # section fields named as top-level ones: set through their section only
    for cls in sections.values():
        names += [f.name for f in dataclasses.fields(cls) if f.name not in top]
        shadowed += [(cls, f.name) for f in dataclasses.fields(cls) if f.name in top]
    assert len(names) == len(set(names)) and sorted(names) == FLAT_NAMES
    assert sorted(flat_fields()) == FLAT_NAMES
    assert shadowed == [(SpeculativeConfig, "model"), (SpeculativeConfig, "quantization")]


def test_flat_overrides_win_over_nested_data() -> None:
    cfg = EngineConfig.from_dict({"cache": {"page_size": 32, "num_pages": 10}}, page_size=8)
    assert (cfg.cache.page_size, cfg.cache.num_pages) == (8, 10)
    cfg = EngineConfig.from_dict(None, cache={"page_size": 4})  # a whole section, nested
    assert cfg.cache.page_size == 4


def test_strings_are_converted_like_command_line_flags() -> None:
    cfg = EngineConfig.from_dict(
        None,
        page_size="8",
        memory_utilization="0.5",
        max_num_batched_tokens="64",
        max_num_seqs="4",
        token_buckets="16,32, 64",
    )
    assert cfg.cache.page_size == 8 and cfg.cache.memory_utilization == 0.5
    assert cfg.scheduler.token_buckets == (16, 32, 64)


def test_unknown_flat_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown config field 'pagesize'") as info:
        EngineConfig.from_dict(None, pagesize=8)
    for name in FLAT_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"page_size": "8.5"}, "cache.page_size must be an integer, got '8.5'"),
        ({"page_size": "--5"}, "cache.page_size must be an integer"),
        ({"page_size": 8.0}, "cache.page_size must be an integer"),
        ({"page_size": None}, "cache.page_size must be an integer, got None"),
        ({"page_size": [8]}, "cache.page_size must be an integer"),
        ({"page_size": True}, "cache.page_size must be an integer, got True"),
        ({"num_pages": -1}, "num_pages must be >= 1"),
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "must be >= max_num_seqs"),
        ({"memory_utilization": "lots"}, "memory_utilization must be a number"),
        ({"memory_utilization": 0}, "memory_utilization must be in"),
        ({"memory_utilization": True}, "memory_utilization must be a number, got True"),
        ({"kv_cache_memory_gb": -1.0}, "kv_cache_memory_gb must be > 0"),
        ({"kv_cache_memory_gb": float("inf")}, "kv_cache_memory_gb must be a finite number"),
        ({"dtype": 32}, "dtype must be a string, got 32"),
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"attention": None}, "attention must be a string, got None"),
        ({"tokenizer": ["a"]}, "tokenizer must be a string"),
        ({"seed": "x"}, "seed must be an integer, got 'x'"),
        ({"token_buckets": 64}, "token_buckets must be a list, got 64"),
        ({"token_buckets": {"a": 1}}, "token_buckets must be a list"),
        ({"token_buckets": [16, None]}, "token_buckets must be an integer, got None"),
        ({"token_buckets": [16.5, 512]}, "token_buckets must be an integer, got 16.5"),
        ({"token_buckets": []}, "token_buckets must not be empty"),
        ({"token_buckets": [32, 16, 512]}, "strictly increasing"),
        ({"token_buckets": [16, 16, 512]}, "strictly increasing"),
        ({"token_buckets": [0, 512]}, "positive"),
        ({"token_buckets": [16, 32]}, r"largest token bucket \(32\) must equal"),
        ({"cache": 5}, "'cache' must be a mapping of its fields, got 5"),
        ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching must be a boolean"),
        ({"srpf_aging": 0}, "srpf_aging must be > 0"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
        ({"watermark": -0.1}, "watermark must be a fraction"),
        ({"watermark": 2.5}, "watermark must be a fraction"),
        ({"max_waiting_requests": 0}, "max_waiting_requests must be >= 1"),
        ({"max_prompt_len": 0}, "max_prompt_len must be >= 1"),
        ({"max_n": 0}, "max_n must be >= 1"),
        ({"max_output_tokens": 0}, "max_output_tokens must be >= 1"),
        ({"max_prompts_per_request": 0}, "max_prompts_per_request must be >= 1"),
    ],
)
def test_bad_values_are_value_errors(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(None, **overrides)


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(FLAT_NAMES),
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 70), 1 << 70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.lists(st.one_of(st.integers(-5, 600), st.text(max_size=3), st.none()), max_size=4),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    ),
)
def test_any_value_is_accepted_or_a_value_error(name: str, value: object) -> None:
    """Whatever a user or a YAML file gives, the answer is a config or a ValueError."""
    try:
        cfg = EngineConfig.from_dict(None, **{name: value})
    except ValueError as exc:
        assert str(exc)
        return
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CacheConfig(page_size="x"), "cache.page_size must be an integer"),
        (lambda: CacheConfig(memory_utilization=None), "cache.memory_utilization must be a"),
        (lambda: SchedulerConfig(token_buckets=[None]), "scheduler.token_buckets must be an"),
        (lambda: SchedulerConfig(max_num_seqs="many"), "scheduler.max_num_seqs must be an"),
        (lambda: KernelConfig(attention=1), "kernels.attention must be a string"),
        (lambda: EngineConfig(dtype=None), "dtype must be a string"),
        (lambda: EngineConfig(cache={"page_size": 8}), "cache must be a CacheConfig"),
        (lambda: EngineConfig(scheduler=None), "scheduler must be a SchedulerConfig"),
    ],
)
def test_direct_construction_is_checked_too(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_direct_construction_converts_gently() -> None:
    assert CacheConfig(page_size="8").page_size == 8
    assert SchedulerConfig(max_num_batched_tokens=64, token_buckets=[16, 64]).token_buckets == (
        16,
        64,
    )
    assert EngineConfig(model=Path("/models/x")).model == "/models/x"


def test_from_dict_rejects_non_mappings() -> None:
    for data in ([1, 2], "cache", 5):
        with pytest.raises(ValueError, match="config must be a mapping"):
            EngineConfig.from_dict(data)


def test_from_dict_does_not_mutate_its_input() -> None:
    data = {"cache": {"page_size": 8}, "dtype": "float32"}
    EngineConfig.from_dict(data, page_size=4, num_pages=9)
    assert data == {"cache": {"page_size": 8}, "dtype": "float32"}


# ---- replace and round trips ------------------------------------------------------------


def test_replace() -> None:
    cfg = EngineConfig.from_dict(None, page_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    new = cfg.replace(page_size=16, dtype="bfloat16")
    assert (new.cache.page_size, new.dtype) == (16, "bfloat16")
    assert new.scheduler == cfg.scheduler and cfg.cache.page_size == 8  # cfg is untouched
    assert cfg.replace() == cfg
    with pytest.raises(ValueError, match="unknown config field"):
        cfg.replace(pagesize=3)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        cfg.replace(page_size=0)


def test_replace_keeps_bucket_consistency() -> None:
    cfg = EngineConfig.from_dict(None, max_num_batched_tokens=64, token_buckets=[16, 64])
    with pytest.raises(ValueError, match="largest token bucket"):
        cfg.replace(max_num_batched_tokens=128)
    new = cfg.replace(max_num_batched_tokens=128, token_buckets=[16, 64, 128])
    assert new.scheduler.token_buckets == (16, 64, 128)


def test_config_is_frozen_and_hashable() -> None:
    cfg = EngineConfig.from_dict(None, token_buckets=[16, 512])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dtype = "bfloat16"  # type: ignore[misc]
    assert hash(cfg) == hash(EngineConfig.from_dict(cfg.to_dict()))


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    max_num_seqs = draw(st.integers(1, 64))
    budget = draw(st.integers(max(max_num_seqs, 2), 4096))
    buckets = draw(
        st.none()
        | st.lists(st.integers(1, budget - 1), max_size=4, unique=True).map(
            lambda b: [*sorted(b), budget]
        )
    )
    sizing = draw(st.sampled_from(["auto", "pages", "memory"]))
    return EngineConfig.from_dict(
        None,
        model=draw(st.none() | st.text(min_size=1, max_size=10)),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        max_model_len=draw(st.none() | st.integers(1, 8192)),
        seed=draw(st.integers(-(2**63), 2**63)),
        page_size=draw(st.integers(1, 256)),
        num_pages=draw(st.integers(1, 10**6)) if sizing == "pages" else None,
        kv_cache_memory_gb=draw(st.floats(0.01, 100)) if sizing == "memory" else None,
        memory_utilization=draw(st.floats(0.01, 1.0)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        token_buckets=buckets,
        attention=draw(st.sampled_from(["auto", "xla", "pallas"])),
    )


@settings(max_examples=60, deadline=None)
@given(configs())
def test_round_trip(cfg: EngineConfig) -> None:
    plain = cfg.to_dict()
    assert EngineConfig.from_dict(plain) == cfg
    assert set(plain) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert cfg.replace() == cfg
    # The plain dict is what a YAML preset holds.
    yaml = pytest.importorskip("yaml")
    assert EngineConfig.from_dict(yaml.safe_load(yaml.safe_dump(plain))) == cfg


def test_speculative_config_as_vllm_spells_it() -> None:
    """The section takes vLLM's dict: as a keyword, in YAML, or as --speculative-config
    JSON (its fields' own flags apply after it); bad values are one-line errors."""
    import argparse

    from jaxcb.cli import add_engine_args, engine_config_from_args

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    cfg = EngineConfig.from_dict(None, speculative_config=spec)
    assert (cfg.speculative_config.method, cfg.speculative_config.prompt_lookup_max) == ("ngram", 5)
    assert cfg.max_num_sample_rows == cfg.scheduler.max_num_seqs * 4
    assert EngineConfig().max_num_sample_rows == EngineConfig().scheduler.max_num_seqs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram"}', "--num-speculative-tokens", "2"]
    )
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{ngram}"])  # argparse: not valid JSON
    with pytest.raises(ValueError, match="speculative method must be one of"):
        EngineConfig.from_dict(None, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        EngineConfig.from_dict(
            None, speculative_config={"method": "ngram", "num_speculative_tokens": 0}
        )
    with pytest.raises(ValueError, match="unknown key 'draft'"):
        EngineConfig.from_dict(None, speculative_config={"draft": 1})
    # a draft model: `model` alone selects it (as vLLM); the target's own checkpoint
    # needs a cheaper form; --model and --quantization stay the target's
    draft = EngineConfig.from_dict(None, speculative_config={"model": "d.gguf"})
    assert draft.speculative_config.method == "draft_model"
    args = parser.parse_args(
        ["--model", "t", "--quantization", "int8", "--speculative-config", '{"model": "d"}']
    )
    built = engine_config_from_args(args)
    assert (built.model, built.quantization) == ("t", "int8")
    assert (built.speculative_config.model, built.speculative_config.quantization) == ("d", None)
    with pytest.raises(ValueError, match="a draft_model needs `model`"):
        EngineConfig.from_dict(None, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative quantization must be one of"):
        EngineConfig.from_dict(None, speculative_config={"model": "d", "quantization": "q4"})
    with pytest.raises(ValueError, match="are a draft_model's, not 'ngram'"):
        EngineConfig.from_dict(None, speculative_config={"method": "ngram", "quantization": "int8"})


def test_lora_fields_and_their_checks() -> None:
    config = EngineConfig.from_dict(enable_lora=True, max_loras=4, max_lora_rank=64)
    assert config.lora == LoraConfig(enable_lora=True, max_loras=4, max_lora_rank=64)
    assert EngineConfig.from_dict({"lora": {"enable_lora": True}}).lora.max_loras == 1
    for flat, message in [
        ({"max_loras": 0}, "max_loras must be in"),
        ({"max_lora_rank": 1024}, "max_lora_rank must be in"),
        ({"enable_lora": True, "batching": "static"}, "enable_lora needs batching continuous"),
        ({"enable_lora": True, "scan_layers": False}, "enable_lora needs kernels.scan_layers"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_dict(**flat)
