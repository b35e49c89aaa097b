"""Quantized KV pages end to end on the built-in tiny model (kv_cache_dtype int8 and fp8):
they generate; preemption by recompute and by swap and prefix caching change no token (the
same quantized config without them is the reference: recomputed K/V quantize to the same
codes, swapped pages come back bit for bit, cached pages are the codes a recompute would
write); nothing compiles after warm-up; the pool holds more pages in the same memory; and
stats() and /metrics say what the pool is."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.attention import check_kv_cache_dtype
from jaxcb.config import CacheConfig, EngineConfig
from jaxcb.models import registry
from jaxcb.runtime import kv_cache, kv_swap
from jaxcb.runtime import step as step_module
from jaxcb.server.metrics import ServerMetrics

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[64],  # one bucket: few compiles
    seq_buckets=[8],
    max_model_len=256,
    page_size=8,
)
KV_MEMORY_GB = 0.002  # int8: 466 pages of 8 tokens, no preemption
SMALL_POOL = dict(num_pages=40)  # 320 tokens for 8 requests of up to ~140: preemption
PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
DTYPES = ["int8", "fp8"]


def prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts sharing a 24-token prefix (3 pages), then 1-80 tokens of their own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 300, size=24).tolist()
    return [prefix + rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(1, 80, n)]


@pytest.fixture(scope="module", params=DTYPES)
def engines(request) -> dict[str, LLM]:
    """Per quantized dtype: a pool large enough for everything, and a small one preempting
    by recompute and by swap."""
    kv = dict(kv_cache_dtype=request.param)
    return {
        "dtype": request.param,
        "large": LLM(**CONFIG, **kv, kv_cache_memory_gb=KV_MEMORY_GB),
        "recompute": LLM(**CONFIG, **kv, **SMALL_POOL, preemption_mode="recompute"),
        "swap": LLM(**CONFIG, **kv, **SMALL_POOL, preemption_mode="swap"),
    }


@pytest.fixture(scope="module")
def bf16_pages() -> int:
    """Pages of a bfloat16 pool in the same memory."""
    llm = LLM(**CONFIG, kv_cache_dtype="bfloat16", kv_cache_memory_gb=KV_MEMORY_GB)
    return llm.engine.info.num_pages


def run_checked(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt's tokens, stepping the engine with the page invariant checked each step."""
    engine = llm.engine
    ids = [engine.add_request(None, p, PARAMS) for p in ps]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        engine.check_page_invariant()
    assert engine.pool.num_used == 0 and engine.kv_usage().num_swap_used == 0
    return [tokens[i] for i in ids]


def test_kv_cache_dtype_names_and_bad_values():
    for name, dtype in [
        ("int8", jnp.int8),
        ("fp8", jnp.float8_e4m3fn),
        ("fp8_e4m3", jnp.float8_e4m3fn),
        ("fp8_e5m2", jnp.float8_e5m2),
        ("bfloat16", jnp.bfloat16),
    ]:
        assert kv_cache.resolve_kv_cache_dtype(name, jnp.float32, "native") == jnp.dtype(dtype)
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
    for bad in ("int4", "fp8_e4m3fn", "float8"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as exc:
            EngineConfig.from_dict(kv_cache_dtype=bad)
        assert "fp8_e5m2" in str(exc.value) and len(str(exc.value).splitlines()) == 1


def test_kv_dtypes_a_backend_cannot_take(caplog):
    """float16 pages: not read by the native kernels (a one-line error naming the field);
    fp8 pages with attention xla on CPU: read, but XLA converts the pool on every write (a
    warning); int8 and fp8 with native, int8 with xla: nothing to say."""
    with pytest.raises(ValueError, match="kv_cache_dtype='float16' gives float16") as exc:
        check_kv_cache_dtype("native", jnp.float16, "float16", "cpu")
    assert len(str(exc.value).splitlines()) == 1
    for backend, dtype in [("native", "int8"), ("native", "fp8"), ("xla", "int8")]:
        kv = kv_cache.resolve_kv_cache_dtype(dtype, jnp.float32, backend, "cpu")
        check_kv_cache_dtype(backend, kv, dtype, "cpu")
        check_kv_cache_dtype("pallas-gpu", kv, dtype, "gpu")
    assert not caplog.records
    check_kv_cache_dtype("xla", jnp.float8_e5m2, "fp8_e5m2", "cpu")
    assert "converts a float8 pool" in caplog.text
    check_kv_cache_dtype("xla", jnp.float8_e5m2, "fp8_e5m2", "tpu")  # (no warning off CPU)
    assert len(caplog.records) == 1


def test_quantized_pages_preempted_and_swapped_give_the_same_tokens(engines):
    """Recompute and swap against the pool that never preempts: token for token."""
    large, recompute, swap = engines["large"], engines["recompute"], engines["swap"]
    state = large.engine.runner.state.kv_caches
    assert len(state) == 4 and state[2].dtype == jnp.float32  # codes, then their scales
    assert str(state[0].dtype) == {"int8": "int8", "fp8": "float8_e4m3fn"}[engines["dtype"]]
    traces, swap_traces = step_module.TRACE_COUNT[0], kv_swap.SWAP_TRACE_COUNT[0]
    ps = prompts(8, seed=3)
    want = run_checked(large, ps)
    assert all(len(t) == PARAMS.max_tokens for t in want)
    assert len({t for ts in want for t in ts}) > 40, "outputs too repetitive to compare"
    assert large.stats()["preemptions"] == 0
    assert run_checked(recompute, ps) == want
    assert recompute.stats()["preemptions"] > 0
    assert run_checked(swap, ps) == want
    stats = swap.stats()
    assert stats["swapped_out_requests"] > 0 and stats["swap_fallbacks"] == 0
    assert stats["swapped_in_requests"] == stats["swapped_out_requests"]
    assert step_module.TRACE_COUNT[0] == traces, "the step function was traced again"
    assert kv_swap.SWAP_TRACE_COUNT[0] == swap_traces, "a swap copy was compiled after warm-up"


def test_prefix_caching_changes_no_token(engines):
    """Cached pages (their codes and scales) give the tokens a recompute of the prefix gives."""
    large = engines["large"]
    uncached = LLM(
        **CONFIG,
        kv_cache_dtype=engines["dtype"],
        kv_cache_memory_gb=KV_MEMORY_GB,
        enable_prefix_caching=False,
    )
    ps = prompts(6, seed=5)
    first = run_checked(large, ps)
    hits = large.stats()["prefix_hits"]
    assert run_checked(large, ps) == first  # every prompt's full pages now cached
    assert large.stats()["prefix_hits"] - hits >= 6 * 24
    assert run_checked(uncached, ps) == first
    assert uncached.stats()["prefix_hits"] == 0


def test_pool_holds_more_pages_in_the_same_memory(engines, bf16_pages):
    """int8 / fp8 at head_dim 32 (the tiny model): 32 + 4 bytes a row against bfloat16's 64,
    1.78x the pages; at head_dim 64 (SmolLM2, Llama 3 has 128): 68 against 128, 1.88x."""
    quantized, plain = engines["large"].engine.info.num_pages, bf16_pages
    d = 32
    assert quantized == int(KV_MEMORY_GB * 2**30 // (8 * 2 * 4 * 2 * (d + 4)))
    assert quantized / plain == pytest.approx(2 * d / (d + 4), rel=0.01)
    spec = registry.spec_from_hf_config(
        {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 64}
    )
    sized = {
        dtype: kv_cache.size_kv_pool(
            CacheConfig(kv_cache_memory_gb=1.0),
            spec,
            dtype=dtype,
            max_model_len=256,
            max_num_seqs=8,
        ).num_pages
        for dtype in ("bfloat16", "int8", "float8_e4m3fn")
    }
    assert sized["int8"] == sized["float8_e4m3fn"] >= 1.8 * sized["bfloat16"]
    assert sized["int8"] / sized["bfloat16"] == pytest.approx(128 / 68, rel=1e-3)


def test_stats_and_metrics_say_what_the_pool_is(engines):
    large = engines["large"]
    info = large.engine.info
    stats = large.stats()
    per_token = 2 * 4 * 2 * (32 + 4)  # K and V, 4 layers, 2 KV heads, 32 codes + a scale
    assert stats["kv_cache_dtype"] == {"int8": "int8", "fp8": "float8_e4m3fn"}[engines["dtype"]]
    assert stats["kv_bytes_per_token"] == info.kv_bytes_per_token == per_token
    assert stats["kv_pages_total"] == info.num_pages
    assert stats["kv_cache_bytes"] == info.num_pages * 8 * per_token
    assert stats["weight_bytes"] == info.weight_bytes > 0
    metrics = ServerMetrics("tiny", info.token_buckets)
    metrics.engine_info(info)
    text = metrics.render().decode()
    values = {
        line.partition("{")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("jaxcb:") and 'model_name="tiny"' in line
    }
    assert values["jaxcb:kv_bytes_per_token"] == per_token
    assert values["jaxcb:num_kv_pages"] == info.num_pages
    assert values["jaxcb:kv_cache_bytes"] == info.kv_cache_bytes
    assert values["jaxcb:weight_bytes"] == info.weight_bytes
    assert f'kv_cache_dtype="{stats["kv_cache_dtype"]}"' in text
    assert values["jaxcb:cache_config_info"] == 1
