"""Async scheduling end to end on the built-in tiny model: one engine, run with it off and on
(the same compiled buckets serve both), gives the same tokens, logprobs and finish reasons for
greedy and seeded sampling, stop strings, stop tokens, max_tokens, penalties, n > 1 and
prompt logprobs, on a pool small enough to preempt; aborts of requests with a step in flight
free every page and stream nothing after; no step is compiled after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.runtime import step as step_module

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 32, 64],
    max_model_len=256,
    page_size=8,
    num_pages=40,  # 320 tokens for 8 requests of up to ~140: preemption is routine
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**CONFIG)


def prompts(n: int, seed: int, max_len: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(2, max_len, size=n)]


def run(llm: LLM, requests: list, *, on: bool, aborts: dict[int, int] | None = None) -> dict:
    """Step the engine to the end with async scheduling `on`, checking the page invariant
    after every step; `aborts`: request index -> abort once it has streamed that many
    tokens. Returns each request's final output by index."""
    engine = llm.engine
    llm.reset_prefix_cache()
    engine.async_scheduling = on
    aborts = dict(aborts or {})
    ids = [engine.add_request(None, p, sp) for p, sp in requests]
    index = {rid: i for i, rid in enumerate(ids)}
    final: dict[int, object] = {}
    inflight_aborts = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = index[out.request_id]
            assert i not in final, "an output after the request finished"
            if out.finished:
                final[i] = out
            elif i in aborts and len(out.outputs[0].token_ids) >= aborts[i]:
                inflight_aborts += engine._inflight is not None
                final[i] = engine.abort_request(out.request_id)
                del aborts[i]
        engine.check_page_invariant()
    assert engine.pool.num_used == 0 and engine._inflight is None
    assert not aborts, "a request to abort finished first"
    if on and final and any(o.finish_reason == "abort" for o in final.values()):
        assert inflight_aborts > 0
    return final


def outcome(out) -> tuple:
    return tuple((tuple(o.token_ids), o.finish_reason, o.stop_reason, o.text) for o in out.outputs)


def test_the_same_tokens_with_and_without_async_scheduling(llm):
    ps = prompts(8, seed=3)
    ref, ref3 = llm.generate(
        [ps[0], ps[3]], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False
    )
    stop_str = ref.text[10:12]
    assert len(stop_str) == 2 and len(ref3.token_ids) > 10
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    requests = [
        (ps[0], SamplingParams(max_tokens=40, temperature=0, stop=[stop_str])),
        (ps[1], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, logprobs=1)),
        (ps[2], SamplingParams(max_tokens=7, temperature=0.7, top_k=20, seed=5)),
        (ps[3], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref3.token_ids[9]])),
        (ps[4], SamplingParams(max_tokens=25, temperature=1.0, seed=2, n=2)),
        (ps[5], SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.8, seed=1)),
        (ps[6], SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=2)),
        (ps[7], greedy),
    ]
    want = run(llm, requests, on=False)
    sync_stats = llm.stats()
    traces = step_module.TRACE_COUNT[0]
    got = run(llm, requests, on=True)
    stats = llm.stats()
    assert step_module.TRACE_COUNT[0] == traces, "async scheduling compiled a step"
    assert stats["preemptions"] > sync_stats["preemptions"] > 0  # both runs preempted
    assert stats["async_drains"] > 0  # the penalty request's steps waited for its tokens
    assert want[0].finish_reason == "stop" and want[0].outputs[0].stop_reason == stop_str
    assert want[3].finish_reason == "stop"
    assert len({t for o in want.values() for t in o.token_ids}) > 40, "outputs too repetitive"
    for i in range(len(requests)):
        assert outcome(got[i]) == outcome(want[i]), f"request {i}"
        for g, w in zip(got[i].outputs, want[i].outputs, strict=True):
            np.testing.assert_allclose(g.logprobs or [], w.logprobs or [], atol=1e-4)
    assert got[6].prompt_logprobs is not None
    for g, w in zip(got[6].prompt_logprobs[1:], want[6].prompt_logprobs[1:], strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_allclose(list(g.values()), list(w.values()), atol=1e-4)


def test_aborts_with_a_step_in_flight_free_everything(llm):
    ps = prompts(8, seed=9)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    requests = [(p, params) for p in ps]
    want = run(llm, requests, on=False)
    aborts = {0: 1, 3: 5, 6: 12}
    got = run(llm, requests, on=True, aborts=aborts)
    for i in range(len(requests)):
        tokens = got[i].outputs[0].token_ids
        if i in aborts:
            assert got[i].finish_reason == "abort"
            assert tokens == want[i].token_ids[: len(tokens)] and len(tokens) >= aborts[i]
        else:
            assert outcome(got[i]) == outcome(want[i]), f"request {i}"
