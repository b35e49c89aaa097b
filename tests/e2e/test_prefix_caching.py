"""Prefix caching, policies, limits and fault isolation on the real engine (tiny model).

Caching must never change a token: the shared-prefix workload gives identical greedy output
with caching on and off, with the page-pool invariant checked after every step and every
reference returned at the end, also in a pool small enough to evict and preempt.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 64],
    max_model_len=256,
    page_size=8,
    num_pages=128,
)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cached() -> LLM:
    return LLM(**CONFIG)


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return LLM(**CONFIG, enable_prefix_caching=False)


def shared_prefix_prompts(
    n: int, *, seed: int, num_prefixes: int = 1, prefix_len: int = 50
) -> list[list[int]]:
    """n prompts: one of `num_prefixes` common prefixes, then 1-20 tokens of their own."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 300, size=prefix_len).tolist() for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + rng.integers(3, 300, size=int(rng.integers(1, 21))).tolist()
        for i in range(n)
    ]


def run_checked(llm: LLM, prompts, params, **kw) -> list:
    """Generate step by step, checking the page invariant after every step. `params`: one
    SamplingParams for all prompts, or one each."""
    engine = llm.engine
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [engine.add_request(None, p, sp, **kw) for p, sp in zip(prompts, params, strict=True)]
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.check_page_invariant()
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.info.num_pages
    engine.pool.check_invariant([])  # every reference returned
    return [results[i] for i in ids]


def test_caching_on_and_off_give_identical_tokens(cached, uncached):
    prompts = shared_prefix_prompts(24, seed=0, num_prefixes=2)
    before = cached.stats()
    on = run_checked(cached, prompts, GREEDY)
    off = run_checked(uncached, prompts, GREEDY)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert len({tuple(o.token_ids) for o in on}) > 12  # the outputs are diverse
    stats = cached.stats()
    assert stats["prefix_hits"] - before["prefix_hits"] > 0
    assert uncached.stats()["prefix_queries"] == 0 and uncached.stats()["kv_pages_cached"] == 0
    assert sum(o.num_cached_tokens for o in on) > 0
    assert all(o.num_cached_tokens == 0 for o in off)


def test_hit_tokens_are_counted_exactly(cached):
    """page_size 8: prompts of 40 tokens (5 full pages) sharing known prefixes."""
    cached.reset_prefix_cache()
    rng = np.random.default_rng(1)
    a = rng.integers(3, 300, size=40).tolist()
    b = a[:35] + rng.integers(3, 300, size=9).tolist()  # shares 4 full pages (32 tokens)
    c = list(a)  # all 5 pages cached, but the last must be computed: 4 pages (32 tokens)
    d = [*a[:7], a[7] + 1, *a[8:]]  # differs inside page 0: nothing
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    s0 = cached.stats()
    first = cached.generate([a], sp, use_tqdm=False)[0]
    s1 = cached.stats()
    assert first.num_cached_tokens == 0
    assert (s1["prefix_queries"] - s0["prefix_queries"], s1["prefix_hits"] - s0["prefix_hits"]) == (
        40,
        0,
    )
    outs = [cached.generate([p], sp, use_tqdm=False)[0] for p in (b, c, d)]
    s2 = cached.stats()
    assert [o.num_cached_tokens for o in outs] == [32, 32, 0]
    assert s2["prefix_queries"] - s1["prefix_queries"] == 44 + 40 + 40
    assert s2["prefix_hits"] - s1["prefix_hits"] == 64
    assert outs[1].token_ids == first.token_ids  # c is a: same tokens from the cache
    assert 0 < s2["prefix_hit_rate"] < 1
    # a's K/V reach position 41 (40 prompt + 2 fed outputs): its 5 full pages are cached
    longer = a + first.token_ids[:2] + [7] * 6  # 48 tokens: 6 full pages, 5 cached
    out = cached.generate([longer], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40


def test_eviction_and_preemption_under_pressure_keep_tokens(uncached):
    """A pool of 40 pages (320 tokens) for 8 running requests of up to ~150 tokens, with four
    prefixes: cached pages are evicted and requests preempted, tokens stay the same."""
    prompts = shared_prefix_prompts(20, seed=2, num_prefixes=4, prefix_len=60)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    tight = LLM(**{**CONFIG, "num_pages": 40})
    got = run_checked(tight, prompts, params)
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["kv_pages_evicted"] > 0 and stats["prefix_hits"] > 0
    want = uncached.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

    # A preempted request's recompute finds its own pages: prompts share nothing here.
    tight.reset_prefix_cache()
    rng = np.random.default_rng(3)
    own = [rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(20, 90, size=10)]
    before = tight.stats()
    got = run_checked(tight, own, params)
    after = tight.stats()
    assert after["preemptions"] > before["preemptions"]
    assert after["prefix_hits"] > before["prefix_hits"]  # recompute hits, nothing else can
    want = uncached.generate(own, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_seeded_sampling_and_penalties_unchanged_by_cache_hits(cached, uncached):
    prompts = shared_prefix_prompts(6, seed=4)
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)
    ] + [
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=3.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, presence_penalty=1.5, ignore_eos=True),
    ]
    cached.generate(prompts, GREEDY, use_tqdm=False)  # warm the cache with the prefixes
    on = cached.generate(prompts, params, use_tqdm=False)
    off = uncached.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in on)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


# ---- priority, limits, fault isolation ----------------------------------------------------


def test_priority_needs_the_priority_policy(cached):
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        cached.generate([[5, 6]], GREEDY, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        cached.generate([[5, 6]], GREEDY, priority=[0, 0], use_tqdm=False)
    assert not cached.engine.has_unfinished_requests()


def test_priority_policy_end_to_end():
    llm = LLM(**{**CONFIG, "max_num_seqs": 1, "scheduling_policy": "priority"})
    prompts = shared_prefix_prompts(4, seed=5)
    outs = llm.generate(prompts, GREEDY, priority=[3, 0, -2, 0], use_tqdm=False)
    first_token = [o.metrics.first_token_time for o in outs]
    assert sorted(range(4), key=first_token.__getitem__) == [2, 1, 3, 0]
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_limits_are_enforced_with_clear_errors():
    llm = LLM(
        **{**CONFIG, "token_buckets": [64]},
        max_prompt_len=20,
        max_n=2,
        max_output_tokens=5,
    )
    with pytest.raises(ValueError, match="21 tokens, more than max_prompt_len=20"):
        llm.generate([[5] * 21], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="n must be <= max_n=2, got 3"):
        llm.generate([[5]], SamplingParams(n=3), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens must be <= max_output_tokens=5, got 6"):
        llm.generate([[5]], SamplingParams(max_tokens=6), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5] * 20], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 5  # no max_tokens: capped, not an error


def test_a_failing_request_fails_alone(cached):
    """A detokenizer (or stop-string) exception fails that request only: finish_reason
    'error' with the message, its pages freed; the others finish with their usual tokens."""
    engine = cached.engine
    prompts = shared_prefix_prompts(5, seed=6)
    want = cached.generate(prompts, GREEDY, use_tqdm=False)
    ids = [engine.add_request(None, p, GREEDY) for p in prompts]
    calls = {"n": 0}
    detok = engine.output_processor.groups[ids[2]].detokenizers[0]
    original = detok.add_token

    def broken(token: int):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("stop-string matcher exploded")
        return original(token)

    detok.add_token = broken
    # and one whose output cannot even be built
    engine.output_processor.groups[ids[4]].detokenizers[0].visible_text = lambda finished: 1 / 0
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.check_page_invariant()
    assert engine.pool.num_used == 0
    for i, request_id in enumerate(ids):
        out = results[request_id]
        if i == 2:
            assert out.finish_reason == "error" and "stop-string matcher exploded" in out.error
            assert out.token_ids == want[i].token_ids[:3]
        elif i == 4:
            assert out.finish_reason == "error" and "ZeroDivisionError" in out.error
        else:
            assert out.error is None and out.token_ids == want[i].token_ids
    assert cached.stats()["failed"] >= 2
