"""Preemption by swap end to end on the built-in tiny model: the same greedy tokens as
preemption by recompute, host pages that never leak (aborts while swapped out included), the
host pool's bound falling back to recompute, and no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.runtime import kv_swap
from jaxcb.runtime import step as step_module
from jaxcb.server.metrics import ServerMetrics

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 32, 64],
    max_model_len=256,
    page_size=8,
    num_pages=40,  # 320 tokens for 8 requests of up to ~140: preemption is routine
)
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int, max_len: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(1, max_len, size=n)]


@pytest.fixture(scope="module")
def recompute() -> LLM:
    return LLM(**CONFIG, preemption_mode="recompute")


@pytest.fixture(scope="module")
def swap() -> LLM:
    return LLM(**CONFIG, preemption_mode="swap")


def run_checked(llm: LLM, ps: list[list[int]], abort_swapped: bool = False) -> dict[str, list]:
    """Step the engine to the end, checking the page and host-slot invariants after every
    step; with `abort_swapped`, abort the first request seen swapped out. Returns each
    request's tokens (None if aborted)."""
    engine = llm.engine
    ids = [engine.add_request(None, p, PARAMS) for p in ps]
    tokens: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        engine.check_page_invariant()
        swapped = [r for r in engine.scheduler.waiting if r.swap_slots is not None]
        if abort_swapped and swapped:
            held = engine.kv_usage().num_swap_used
            slots = len(swapped[0].swap_slots)
            engine.abort_request(swapped[0].request_id)
            assert slots > 0 and engine.kv_usage().num_swap_used == held - slots
            assert swapped[0].swap_slots is None
            tokens[swapped[0].request_id] = None
            abort_swapped = False
            engine.check_page_invariant()
    assert engine.pool.num_used == 0 and engine.kv_usage().num_swap_used == 0
    assert not abort_swapped, "no request was ever swapped out"
    return {i: tokens[i] for i in ids}


def test_swap_gives_the_tokens_of_recompute_and_compiles_nothing_new(recompute, swap):
    ps = prompts(8, seed=7)
    want = recompute.generate(ps, PARAMS, use_tqdm=False)
    assert recompute.stats()["preemptions"] > 0 and recompute.stats()["swapped_out_requests"] == 0
    assert len({t for o in want for t in o.token_ids}) > 20, "outputs too repetitive to compare"
    info = swap.engine.info
    assert info.num_swap_pages > 0 and info.swap_bytes_per_s > 0
    traces, swap_traces = step_module.TRACE_COUNT[0], kv_swap.SWAP_TRACE_COUNT[0]
    swap.engine.record_steps()
    got = run_checked(swap, ps)
    records = swap.engine.pop_step_records()
    swap.engine.record_steps(False)
    assert list(got.values()) == [o.token_ids for o in want]
    stats = swap.stats()
    assert stats["preemptions"] > 0
    assert stats["swapped_out_requests"] == stats["preemptions"], "every victim swapped"
    assert stats["swapped_in_requests"] == stats["swapped_out_requests"]
    assert stats["swap_fallbacks"] == 0 and stats["swap_pages_used"] == 0
    assert stats["recomputed_tokens"] == 0
    # the step records carry the swaps, and /metrics counts them from there
    assert sum(r.swapped_out for r in records) == stats["swapped_out_requests"]
    assert sum(r.swapped_in for r in records) == stats["swapped_in_requests"]
    metrics = ServerMetrics("tiny", [16, 32, 64])
    for record in records:
        metrics.step(record)
    text = metrics.render().decode()
    assert f'jaxcb:swapped_out_requests_total{{model_name="tiny"}} {stats["preemptions"]}.0' in text
    assert step_module.TRACE_COUNT[0] == traces, "the step function was traced again"
    assert kv_swap.SWAP_TRACE_COUNT[0] == swap_traces, "a swap copy was compiled after warm-up"


def test_abort_while_swapped_out_frees_host_pages(recompute, swap):
    ps = prompts(8, seed=11)
    want = recompute.generate(ps, PARAMS, use_tqdm=False)
    got = run_checked(swap, ps, abort_swapped=True)
    kept = [(g, w.token_ids) for g, w in zip(got.values(), want, strict=True) if g is not None]
    assert len(kept) == len(ps) - 1
    assert all(g == w for g, w in kept), "the others' tokens changed"


def test_too_small_host_pool_falls_back_to_recompute(recompute):
    """Host room for 3 pages: victims that need more are recomputed (and counted), auto's
    choice for the rest; the tokens stay those of recompute."""
    info = recompute.engine.info
    page_bytes = info.kv_cache_bytes // info.num_pages
    small = LLM(**CONFIG, preemption_mode="auto", swap_space_gb=3 * page_bytes / 2**30)
    assert small.engine.info.num_swap_pages == 3
    ps = prompts(8, seed=7)
    want = recompute.generate(ps, PARAMS, use_tqdm=False)
    got = run_checked(small, ps)
    assert list(got.values()) == [o.token_ids for o in want]
    stats = small.stats()
    assert stats["swap_fallbacks"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["swapped_out_requests"] + stats["swap_fallbacks"] <= stats["preemptions"]


def test_swap_with_a_pool_per_layer(recompute):
    """Unrolled layers (kernels.scan_layers false, the accelerators' default) keep a (K, V)
    pool per layer: the swap copies move each layer's pages, with the same tokens."""
    ps = prompts(8, seed=7)
    want = recompute.generate(ps, PARAMS, use_tqdm=False)
    unrolled = LLM(**CONFIG, preemption_mode="swap", scan_layers=False)
    assert isinstance(unrolled.engine.runner.state.kv_caches, list)
    got = run_checked(unrolled, ps)
    assert list(got.values()) == [o.token_ids for o in want]
    assert unrolled.stats()["swapped_out_requests"] > 0
