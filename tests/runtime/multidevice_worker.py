"""Runs in its own process with 8 forced CPU devices (the device count is fixed when jax's
backend starts, and the rest of the suite runs on one): tensor and data parallel engines on a
tiny model, and what they shard. Prints one JSON object; test_tensor_parallel.py checks it.

    python tests/runtime/multidevice_worker.py WORK_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any device is touched

import numpy as np  # noqa: E402

from jaxcb import LLM, SamplingParams  # noqa: E402
from jaxcb.models.loading.checkpoint_convert import convert_hf_checkpoint  # noqa: E402
from jaxcb.models.loading.default_model import CONFIG, save_byte_tokenizer, write_random_llama  # noqa: E402
from jaxcb.models.loading.loader import load_model  # noqa: E402
from jaxcb.runtime import sharding  # noqa: E402

# 8 query heads in 4 KV groups: TP 1, 2 and 4 divide it, 8 does not.
TP_CONFIG = dict(
    CONFIG, num_attention_heads=8, num_key_value_heads=4, head_dim=16, intermediate_size=256
)
ENGINE = dict(
    max_model_len=256,
    page_size=16,
    num_pages=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,  # long prompts are prefilled in chunks
    token_buckets=[64],  # one bucket: nine engines compile in this process
)
PARAMS_TO_REPORT = ("embed", "lm_head", "wqkv", "wo", "w_gate_up", "w_down", "attn_norm")


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 320, size=n).tolist() for n in (1, 7, 16, 17, 40, 100)]


def sampling() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    scored = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2)  # 100 tokens
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=7)
    return [greedy] * 4 + [seeded, scored]


def spec_of(array: jax.Array | dict[str, jax.Array]) -> list | dict:
    if isinstance(array, dict) and "q" in array:  # an int8 weight (models/quant.py)
        return {part: spec_of(value) for part, value in array.items()}
    if isinstance(array, dict):  # {kernel: packed}: a weight packed for a native matmul
        (array,) = array.values()
    return [None if a is None else str(a) for a in array.sharding.spec]


def run(model: Path, *, server: bool = False, **overrides) -> dict:
    llm = LLM(str(model), **ENGINE, **overrides)
    outs = llm.generate(prompts(), sampling(), use_tqdm=False)
    engine = llm.engine
    replicas = getattr(engine, "replicas", [engine])
    # a level, not a count: the replicas' budgets are not summed (no ITL target: the fixed one)
    report = {"tokens": [o.token_ids for o in outs], "replicas": []}
    report["prefill_budget"] = engine.stats()["prefill_budget"]
    # the prompt logprobs (the LM head over a vocab-sharded weight under tensor parallelism)
    report["prompt_logprobs"] = [
        [[t, lp] for entry in o.prompt_logprobs[1:] for t, lp in entry.items()]
        for o in outs
        if o.prompt_logprobs is not None
    ]
    for replica in replicas:
        k_pages, *rest = replica.runner.state.kv_caches
        params = replica.runner.params
        named = {"embed": params["embed"], "lm_head": params["lm_head"], **params["layers"][0]}
        report["replicas"].append(
            {
                "devices": sorted(d.id for d in k_pages.sharding.device_set),
                "kv_spec": spec_of(k_pages),
                "kv_shape": list(k_pages.shape),
                "num_layers": replica.runner.spec.num_layers,
                "kv_shard_shapes": [list(s.data.shape) for s in k_pages.addressable_shards],
                # a quantized pool's K scales (None: float pages)
                "kv_scales_spec": spec_of(rest[1]) if len(rest) == 3 else None,
                "params": {name: spec_of(named[name]) for name in PARAMS_TO_REPORT},
                "requests": replica.stats()["requests"],
            }
        )
        replica.check_page_invariant()
    if server:
        report["server"] = serve(llm)
    return report


def serve(llm: LLM) -> dict:
    """The OpenAI server on the same engine: one request of four prompts."""
    from starlette.testclient import TestClient

    from jaxcb.server import ServerSettings, build_app

    replicas = getattr(llm.engine, "replicas", [llm.engine])
    before = [r.stats()["requests"] for r in replicas]
    texts = ["Hello", "abc", "x y z", "The fox"]
    body = {"model": "tiny", "prompt": texts, "max_tokens": 6, "temperature": 0}
    app = build_app(llm.engine, ServerSettings(served_model_names=("tiny",)))
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={**body, "return_token_ids": True})
        metrics = client.get("/metrics").text
    choices = sorted(answer.json().get("choices", []), key=lambda c: c["index"])
    offline = llm.generate(texts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    return {
        "status": answer.status_code,
        "tokens": [c.get("token_ids") for c in choices],
        "offline_tokens": [o.token_ids for o in offline],
        "requests_per_replica": [
            r.stats()["requests"] - b for r, b in zip(replicas, before, strict=True)
        ],
        "kv_usage_metric": "jaxcb:kv_cache_usage_perc" in metrics,
    }


def error_of(model: Path, **overrides) -> str:
    try:
        LLM(str(model), **ENGINE, **overrides)
    except ValueError as exc:
        return str(exc)
    return ""


def main(work: Path) -> None:
    model = work / "tiny-tp"
    write_random_llama(model, TP_CONFIG, seed=1, std=0.2)
    save_byte_tokenizer(model)
    results: dict = {"num_devices": jax.device_count()}
    runs = {
        "tp1": dict(attention="native"),
        "tp2": dict(attention="native", tensor_parallel_size=2),
        "tp4": dict(attention="native", tensor_parallel_size=4),
        "tp2-xla": dict(attention="xla", tensor_parallel_size=2),
        "tp4-xla": dict(attention="xla", tensor_parallel_size=4),
        "dp2": dict(attention="native", data_parallel_size=2, server=True),
        "dp2-tp2": dict(attention="native", mesh_shape=[2, 2]),
        "int8": dict(attention="native", quantization="int8"),
        "int8-tp2": dict(attention="native", quantization="int8", tensor_parallel_size=2),
        # int8 KV pages with their scales, split by KV head (the swap copies compiled too)
        "int8kv": dict(attention="native", kv_cache_dtype="int8"),
        "int8kv-tp2": dict(
            attention="native",
            kv_cache_dtype="int8",
            tensor_parallel_size=2,
            preemption_mode="swap",
        ),
    }
    for name, overrides in runs.items():
        results[name] = run(model, **overrides)

    # orbax: convert, then restore straight into a tensor-parallel mesh.
    orbax_dir = convert_hf_checkpoint(model, work / "tiny-tp-orbax")
    mesh = sharding.replica_mesh(2)
    loaded = load_model(
        orbax_dir,
        tokenizer_path=None,
        dtype=np.float32,
        shardings=lambda spec: sharding.model_param_shardings(spec, mesh=mesh),
    )
    wqkv = loaded.params["layers"][0]["wqkv"]
    results["orbax_restored"] = {
        "format": loaded.format,
        "is_jax_array": isinstance(wqkv, jax.Array),
        "wqkv_spec": spec_of(wqkv),
        "wqkv_devices": sorted(d.id for d in wqkv.sharding.device_set),
    }
    results["orbax-tp2"] = run(orbax_dir, attention="native", tensor_parallel_size=2)

    results["errors"] = {
        "tp8": error_of(model, tensor_parallel_size=8),
        "tp16": error_of(model, tensor_parallel_size=16),
        "dp3-tp4": error_of(model, data_parallel_size=3, tensor_parallel_size=4),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
