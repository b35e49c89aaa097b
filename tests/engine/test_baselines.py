"""The padded-batch baselines (engine/sched/baselines.py), driven by a fake model (no jax).

Their padding is checked against the closed forms of the module docstring on constructed
cases, and every run checks the page invariant after each step and that every request got
exactly its tokens.
"""

from __future__ import annotations

import pytest

from jaxcb.engine.request import Request
from jaxcb.engine.sched.baselines import DynamicBatchScheduler, StaticBatchScheduler
from jaxcb.engine.sched.factory import make_scheduler
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.sampling_params import SamplingParams

PAGE = 4


def make_request(rid: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=str(rid),
        prompt_token_ids=[3 + (rid + i) % 50 for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        seed=rid,
        max_tokens=max_tokens,
        eos_token_ids=frozenset(),
        arrival_time=0.0,
    )


def run(batching: str, shapes: list[tuple[int, int]], *, seqs: int, budget: int, pages=512):
    """Serve requests of (prompt_len, max_tokens) to the end; returns (scheduler, steps)
    where a step is (rows x width slots, real tokens, padding)."""
    pool = PagePool(pages)
    sched = make_scheduler(
        batching, page_pool=pool, page_size=PAGE, max_num_seqs=seqs, max_num_batched_tokens=budget
    )
    requests = [make_request(i, n, t) for i, (n, t) in enumerate(shapes)]
    for r in requests:
        sched.add(r)
    steps = []
    while sched.num_unfinished:
        out = sched.schedule()
        assert not out.is_empty and out.num_tokens + out.num_padding_tokens <= budget
        assert len(out.chunks) <= seqs and not out.preempted
        sched.update_after_step(out)
        for chunk in out.chunks:
            if chunk.samples:
                chunk.request.append_token(7)
                if len(chunk.request.output_token_ids) == chunk.request.max_tokens:
                    sched.finish(chunk.request)
        pool.check_invariant(sched.owners())
        steps.append((out.num_tokens, out.num_padding_tokens))
        assert len(steps) < 10_000
    assert pool.num_free == pages
    assert [len(r.output_token_ids) for r in requests] == [t for _, t in shapes]
    return sched, steps


def test_factory_picks_the_class():
    pool = PagePool(8)
    kw = dict(page_pool=pool, page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=8)
    assert type(make_scheduler("continuous", **kw)) is Scheduler
    assert type(make_scheduler("static", **kw)) is StaticBatchScheduler
    assert type(make_scheduler("dynamic", **kw)) is DynamicBatchScheduler
    with pytest.raises(ValueError, match="batching must be one of"):
        make_scheduler("orca", **kw)


def test_batching_is_a_config_field():
    from jaxcb.config import EngineConfig

    assert EngineConfig().scheduler.batching == "continuous"
    assert EngineConfig.from_dict(None, batching="static").scheduler.batching == "static"
    with pytest.raises(ValueError, match="batching must be one of"):
        EngineConfig.from_dict(None, batching="orca")


def test_static_padding_is_the_formula():
    # Two batches of 3: each pads its prompts to the longest and decodes until its slowest
    # request is done: sum(Lmax - n) + sum(Tmax - T) per batch.
    shapes = [(5, 2), (9, 6), (3, 4), (2, 3), (7, 1), (4, 3)]
    sched, steps = run("static", shapes, seqs=3, budget=64)
    expected = 0
    for batch in (shapes[:3], shapes[3:]):
        lmax, tmax = max(n for n, _ in batch), max(t for _, t in batch)
        expected += sum(lmax - n for n, _ in batch) + sum(tmax - t for _, t in batch)
    assert sched.num_padding_tokens == sum(p for _, p in steps) == expected == 26
    # one prefill step (3 x 9 <= 64) and Tmax - 1 decode steps per batch
    assert len(steps) == (1 + 5) + (1 + 2)


def test_static_chunked_prefill_pads_the_same():
    # A budget of 8 with 3 rows: prefill in column chunks of 2, padding unchanged.
    shapes = [(5, 2), (9, 6), (3, 4)]
    sched, steps = run("static", shapes, seqs=3, budget=8)
    assert sched.num_padding_tokens == (4 + 0 + 6) + (4 + 0 + 2)
    assert len(steps) == 5 + 5  # ceil(9 / 2) prefill chunks, then 5 decode steps


def test_dynamic_refill_costs_n_minus_1_times_b_minus_1():
    # Four one-token prompts fill the batch (no padding); request 0 finishes first and its
    # slot takes request 4, whose 8-token prompt is prefilled in one step of 4 rows x 8
    # columns: the three decoding rows pad 7 slots each.
    b, n = 4, 8
    shapes = [(1, 3), (1, 12), (1, 12), (1, 12), (n, 2)]
    sched, steps = run("dynamic", shapes, seqs=b, budget=64)
    assert sched.num_padding_tokens == (n - 1) * (b - 1) == 21
    assert (b - 1 + n, (n - 1) * (b - 1)) in steps


def test_dynamic_refill_group_is_left_padded_and_chunked():
    # Two requests arrive in one refill: the group pads to its longest prompt (5 - 2 = 3),
    # and with a budget of 8 over 4 rows the 5 columns take 3 steps of widths 2, 2, 1.
    shapes = [(1, 2), (1, 2), (1, 20), (1, 20), (5, 3), (2, 3)]
    sched, steps = run("dynamic", shapes, seqs=4, budget=8)
    group_slots = 4 * 5
    real = 5 + 2 + 2 * 3  # the group's prompts + the two decoders' tokens in 3 steps
    assert sched.num_padding_tokens == group_slots - real == 7
    # steps 1-2 serve the one-token prompts; requests 0 and 1 are done after step 2
    assert [n + p for n, p in steps[2:5]] == [8, 8, 4]


def test_continuous_and_baselines_serve_a_random_mix():
    import random

    rng = random.Random(0)
    shapes = [(rng.randint(1, 30), rng.randint(1, 12)) for _ in range(25)]
    for batching in ("continuous", "static", "dynamic"):
        sched, steps = run(batching, shapes, seqs=4, budget=16, pages=64)
        padding = sum(p for _, p in steps)
        if batching == "continuous":
            assert padding == 0
        else:
            assert padding > 0 and sched.num_preemptions == 0


def test_a_request_the_pool_cannot_hold_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs 5 KV pages"):
        run("static", [(10, 10)], seqs=2, budget=16, pages=4)


def test_abort_mid_prefill_frees_pages():
    pool = PagePool(64)
    sched = make_scheduler(
        "dynamic", page_pool=pool, page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=4
    )
    a, b = make_request(0, 9, 3), make_request(1, 2, 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # 2 rows x 2 columns of a 9-wide group
    sched.update_after_step(out)
    sched.finish(a)
    pool.check_invariant(sched.owners())
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update_after_step(out)
        for c in out.chunks:
            if c.samples:
                c.request.append_token(7)
                if len(c.request.output_token_ids) == c.request.max_tokens:
                    sched.finish(c.request)
    assert pool.num_free == 64 and b.output_token_ids == [7, 7, 7]
