"""Preemption by swap on the host scheduler (no jax): the host slot accounting, the cost
model, and the scheduler with swapping driven by the fake model of the property tests.

A fake device holds, per KV slot, the token prefix its K/V encode; swap copies move those
between device pages and host slots exactly as the runner would (out first, then in). Every
slot a step reads must hold the reader's own prefix, so a page swapped out and back wrong, or
reused before it was copied out, fails the read check. A request resumed from swap must go
on from the tokens it had computed (no position fed twice unless it was recomputed).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import (
    EOS,
    Scenario,
    Spec,
    expected_output,
    fake_token,
    make_request,
    run_fake_kv_cache,
    scenarios,
)

from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.engine.sched.swap import SwapCostModel, Swapper, SwapSpace

# ---- the host slots -----------------------------------------------------------------------


def test_swap_space_allocates_frees_and_checks() -> None:
    space = SwapSpace(5)
    a = space.allocate(3)
    assert len(set(a)) == 3 and space.num_used == 3 and space.num_free == 2
    assert space.allocate(3) is None and space.num_used == 3, "a failed allocation took slots"
    b = space.allocate(2)
    assert space.num_free == 0 and space.peak_used == 5
    space.check_invariant([a, b])
    with pytest.raises(RuntimeError, match="free"):
        space.check_invariant([a])  # b's slots are neither free nor held
    space.free(a)
    space.check_invariant([b])
    with pytest.raises(RuntimeError, match="freed but not held"):
        space.free(a[:1])
    with pytest.raises(RuntimeError, match="freed but not held"):
        space.free([5])
    space.free(b)
    assert space.num_free == 5 and space.allocate(0) == []
    assert SwapSpace(0).allocate(1) is None
    with pytest.raises(ValueError, match="num_slots"):
        SwapSpace(-1)


# ---- the cost model -----------------------------------------------------------------------


def test_cost_model_compares_prefill_time_with_copy_time() -> None:
    # 1 MiB pages at 1 GiB/s: a page costs 2 ms out and back.
    cost = SwapCostModel(page_bytes=1 << 20, bytes_per_s=float(1 << 30), max_num_batched_tokens=512)
    assert cost.prefill_tokens_per_s is None
    assert cost.prefers_swap(10, 1), "with nothing measured, recomputing looks endless"
    cost.observe_step(512, 0.5)  # a full step: 1024 tokens/s
    assert cost.prefill_tokens_per_s == pytest.approx(1024)
    assert cost.recompute_seconds(1024) == pytest.approx(1.0)
    assert cost.swap_seconds(1) == pytest.approx(2 / 1024)
    # 16 tokens in 1 page: recompute 15.6 ms > swap 2 ms; 1 token in 16 pages: 1 ms < 31 ms
    assert cost.prefers_swap(16, 1) and not cost.prefers_swap(1, 16)


def test_cost_model_learns_what_the_prefix_cache_gives_back() -> None:
    """Victims that come back to find their pages cached make recomputing cheap, and a
    swap's copy back small: c moves towards the share found cached."""
    cost = SwapCostModel(page_bytes=1 << 20, bytes_per_s=float(1 << 30), max_num_batched_tokens=8)
    cost.observe_step(8, 8 / 1024)  # 1024 tokens/s
    assert cost.prefers_swap(160, 10)  # recompute 156 ms, swap 20 ms
    for _ in range(60):
        cost.observe_resume(160, 150)  # came back to find 150 of its 160 tokens cached
    assert cost.cached_share == pytest.approx(150 / 160, abs=1e-3)
    assert cost.recompute_seconds(160) == pytest.approx(10 / 1024, rel=1e-2)
    assert cost.swap_seconds(10) == pytest.approx((2 - 150 / 160) * 10 / 1024, rel=1e-2)
    assert not cost.prefers_swap(160, 10)  # recompute 9.8 ms, swap 10.4 ms
    for _ in range(60):
        cost.observe_resume(160, 0)  # the cache churns: nothing comes back
    assert cost.cached_share < 0.01 and cost.prefers_swap(160, 10)
    cost.observe_resume(0, 0)  # nothing computed: nothing learnt
    cost.observe_resume(10, 20)  # more cached than it had: all of it
    assert cost.cached_share <= 1


def test_cost_model_rate_comes_from_prefill_heavy_steps() -> None:
    cost = SwapCostModel(page_bytes=1, bytes_per_s=1.0, max_num_batched_tokens=100)
    cost.observe_step(10, 1.0)  # small steps: the fallback rate, all steps together
    cost.observe_step(10, 1.0)
    assert cost.prefill_tokens_per_s == pytest.approx(10)
    cost.observe_step(100, 0.1)  # a full step sets the rate: 1000 tokens/s
    assert cost.prefill_tokens_per_s == pytest.approx(1000)
    cost.observe_step(10, 1.0)  # small steps no longer move it
    assert cost.prefill_tokens_per_s == pytest.approx(1000)
    cost.observe_step(50, 0.1)  # half the budget counts: moving average towards 500
    assert 500 < cost.prefill_tokens_per_s < 1000
    cost.observe_step(0, 1.0)
    cost.observe_step(10, 0.0)
    with pytest.raises(ValueError, match="bytes_per_s"):
        SwapCostModel(page_bytes=1, bytes_per_s=0.0, max_num_batched_tokens=1)


def test_swapper_modes_and_fallbacks() -> None:
    assert Swapper("recompute", SwapSpace(8)).slots_for(16, 2) is None
    swap = Swapper("swap", SwapSpace(3))
    assert swap.slots_for(16, 2) is not None
    assert swap.slots_for(0, 0) is None, "nothing computed: nothing to swap"
    assert swap.slots_for(16, 2) is None and swap.num_fallbacks == 1, "the pool is full"
    assert swap.num_swapped_out == 1
    cost = SwapCostModel(page_bytes=1 << 20, bytes_per_s=float(1 << 30), max_num_batched_tokens=8)
    cost.observe_step(8, 8 / 1024)  # 1024 tokens/s
    auto = Swapper("auto", SwapSpace(100), cost)
    assert auto.slots_for(16, 1) is not None  # recompute 15.6 ms, swap 2 ms
    assert auto.slots_for(1, 16) is None  # recompute 1 ms, swap 31 ms: not a fallback
    assert auto.num_fallbacks == 0 and auto.num_swapped_out == 1
    assert Swapper("auto", SwapSpace(4)).slots_for(1, 16) is None  # no model: swap; no room
    with pytest.raises(ValueError, match="preemption_mode"):
        Swapper("evict", SwapSpace(1))


# ---- the scheduler with swapping, on a fake device ------------------------------------------


class SwapRun:
    """Drives a swapping Scheduler with the fake model and a fake device + host memory."""

    def __init__(self, sc: Scenario, swapper: Swapper) -> None:
        self.sc = sc
        self.pool = PagePool(sc.num_pages)
        self.swapper = swapper
        self.sched = Scheduler(
            page_pool=self.pool,
            page_size=sc.page_size,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            enable_prefix_caching=sc.prefix_caching,
            long_prefill_token_threshold=sc.threshold,
            watermark_pages=sc.watermark_pages,
            swapper=swapper,
        )
        self.requests = {s.rid: make_request(s) for s in sc.specs}
        self.kv: dict[int, tuple[int, ...]] = {}  # device slot -> the prefix its K/V encode
        self.host: dict[int, list[tuple[int, ...] | None]] = {}  # host slot -> a page's slots
        self.fed: Counter[tuple[int, int]] = Counter()  # (rid, position) -> times fed
        self.recomputed: set[int] = set()  # rids preempted by recompute at least once
        self.resume_at: dict[int, int] = {}  # id(swapped request) -> its computed tokens
        self.num_swapped_out = self.num_swapped_in = self.num_fallbacks = 0
        self.aborted_swapped = 0

    def run(self, abort_swapped_at: int | None = None) -> None:
        sc = self.sc
        last_arrival = max(s.arrival_step for s in sc.specs)
        max_steps = last_arrival + len(sc.specs) * (sc.max_model_len + 2) + 10
        for step in range(max_steps):
            for s in sc.specs:
                if s.arrival_step == step:
                    self.sched.add(self.requests[s.rid])
            for s in sc.specs:
                if s.abort_step == step:
                    self.abort(self.requests[s.rid])
            if abort_swapped_at is not None and step >= abort_swapped_at:
                swapped = [r for r in self.sched.waiting if r.swap_slots is not None]
                if swapped:
                    self.abort(swapped[0])
                    abort_swapped_at = None
            if step >= last_arrival and all(r.finished for r in self.requests.values()):
                break
            self.step()
        else:
            pytest.fail(f"not all requests finished within {max_steps} steps")
        self.check_final()

    def abort(self, req: Request) -> None:
        if req.finished:
            return
        held = self.swapper.space.num_used
        slots = len(req.swap_slots or [])
        self.aborted_swapped += slots > 0
        req.finish_reason = "abort"
        self.sched.finish(req)
        assert req.swap_slots is None and req.page_ids == []
        assert self.swapper.space.num_used == held - slots, "an abort kept host slots"
        self.resume_at.pop(id(req), None)
        self.check_between_steps()

    def step(self) -> None:
        sched, sc = self.sched, self.sc
        computed = {id(r): r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        self.check_swaps(out, computed)
        self.copy(out)
        self.run_fake_device(out)
        sched.update_after_step(out)
        for chunk in out.chunks:
            req = chunk.request
            rid = int(req.request_id)
            for pos in range(chunk.start, chunk.end):
                self.fed[(rid, pos)] += 1
                want = (
                    req.prompt_token_ids[pos]
                    if pos < req.num_prompt_tokens
                    else fake_token(rid, pos, sc.eos_every)
                )
                assert req.token_ids[pos] == want
            if chunk.samples:
                req.append_token(fake_token(rid, req.num_tokens, sc.eos_every))
                req.check_stop_tokens(sc.max_model_len)
                if req.finish_reason is not None:
                    sched.finish(req)
        assert len(sched.running) <= sc.max_num_seqs
        self.check_between_steps()

    def check_swaps(self, out: SchedulerOutput, computed: dict[int, int]) -> None:
        ps = self.sc.page_size
        self.num_fallbacks += out.num_swap_fallbacks
        swapped = [v for v in out.preempted if v.swap_slots is not None]
        assert out.num_swapped_out == len(swapped)
        self.num_swapped_out += len(swapped)
        slots_out = [slot for v in swapped for slot in v.swap_slots]
        assert [slot for _, slot in out.swap_out] == slots_out
        for v in out.preempted:
            assert v.status is RequestStatus.WAITING and v.page_ids == []
            if v.swap_slots is None:
                assert v.num_computed_tokens == 0
                self.recomputed.add(int(v.request_id))
            else:  # swapped out with what it had computed before this step
                assert v.num_computed_tokens == computed[id(v)] > 0
                assert len(v.swap_slots) == math.ceil(v.num_computed_tokens / ps)
                self.resume_at[id(v)] = v.num_computed_tokens
        if out.preempted:
            assert not out.swap_in, "a step that preempts admits (and resumes) nothing"
        self.num_swapped_in += out.num_swapped_in
        resumed = [c for c in out.chunks if id(c.request) in self.resume_at]
        assert len(resumed) == out.num_swapped_in
        for chunk in resumed:  # resumed where it stopped, or later if the cache had more
            assert chunk.start >= self.resume_at.pop(id(chunk.request))
        holders = Counter(p for pages in self.sched.owners() for p in pages)
        for _, page in out.swap_in:
            assert holders[page] == 1, f"page {page} swapped into while shared"

    def copy(self, out: SchedulerOutput) -> None:
        """What Runner.swap does: every (page, slot) out, then every (slot, page) in."""
        ps = self.sc.page_size
        for page, slot in out.swap_out:
            self.host[slot] = [self.kv.get(page * ps + i) for i in range(ps)]
        for slot, page in out.swap_in:
            for i, prefix in enumerate(self.host.pop(slot)):
                if prefix is None:
                    self.kv.pop(page * ps + i, None)
                else:
                    self.kv[page * ps + i] = prefix

    def run_fake_device(self, out: SchedulerOutput) -> None:
        run_fake_kv_cache(self.kv, self.sched, out, self.sc.page_size)

    def check_between_steps(self) -> None:
        sched, ps = self.sched, self.sc.page_size
        self.pool.check_invariant(sched.owners())
        swapped = [r.swap_slots for r in sched.waiting if r.swap_slots is not None]
        self.swapper.space.check_invariant(swapped)
        for r in sched.running:
            assert r.swap_slots is None
            assert len(r.page_ids) == math.ceil(r.num_computed_tokens / ps)
        for r in sched.waiting:
            assert r.page_ids == []
            if r.swap_slots is None:
                assert r.num_computed_tokens == 0
            else:
                assert len(r.swap_slots) == math.ceil(r.num_computed_tokens / ps) > 0

    def check_final(self) -> None:
        sched, sc, swapper = self.sched, self.sc, self.swapper
        assert sched.num_unfinished == 0
        assert self.pool.num_free == sc.num_pages and self.pool.num_used == 0
        assert swapper.space.num_used == 0, "host slots leaked"
        assert swapper.num_swapped_out == self.num_swapped_out
        assert swapper.num_swapped_in == self.num_swapped_in
        assert swapper.num_fallbacks == self.num_fallbacks
        # every swap-out ended in a resume or in an abort while swapped out
        assert self.num_swapped_in + self.aborted_swapped == self.num_swapped_out
        for s in sc.specs:
            req = self.requests[s.rid]
            want = expected_output(
                s.rid, s.prompt_len, s.max_tokens, sc.max_model_len, sc.eos_every
            )
            assert req.status is RequestStatus.FINISHED
            if req.finish_reason == "abort":
                assert req.output_token_ids == want[: len(req.output_token_ids)]
            else:
                assert req.output_token_ids == want, f"request {s.rid} generated other tokens"
                assert req.finish_reason == ("stop" if want[-1] == EOS else "length")


@st.composite
def swap_setups(draw: st.DrawFn) -> tuple[Scenario, Swapper, int | None]:
    """A scenario, a swapper (host pool from none to ample; auto with a cost model that makes
    a page cost half or twice what recomputing a full page does) and maybe a step from which
    the first request seen swapped out is aborted."""
    sc = draw(scenarios())
    host_slots = draw(st.sampled_from([0, 1, 2, 5, 1000]))
    mode = draw(st.sampled_from(["swap", "auto"]))
    cost = None
    if mode == "auto":
        page_cost = draw(st.sampled_from([0.5, 2.0])) * sc.page_size  # in tokens recomputed
        cost = SwapCostModel(page_bytes=1, bytes_per_s=2.0 / page_cost, max_num_batched_tokens=1)
        cost.observe_step(1, 1.0)  # recompute: one token a second
    abort_swapped_at = draw(st.one_of(st.none(), st.integers(0, 30)))
    return sc, Swapper(mode, SwapSpace(host_slots), cost), abort_swapped_at


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swap_setups())
def test_swapping_scheduler_properties(setup: tuple[Scenario, Swapper, int | None]) -> None:
    """Random arrivals, aborts, prefix sharing, tight pools, host pools from none to ample,
    swap and auto."""
    sc, swapper, abort_swapped_at = setup
    SwapRun(sc, swapper).run(abort_swapped_at)


def _tight_scenario(*, prefix_caching: bool = False) -> Scenario:
    """Five requests on a pool of one max-length sequence: preemption is certain."""
    sc = Scenario(
        page_size=2,
        max_model_len=32,
        num_pages=16,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        eos_every=0,
        prefix_caching=prefix_caching,
    )
    for rid, (arrival, prompt_len) in enumerate([(0, 5), (0, 7), (1, 3), (2, 9), (2, 2)]):
        sc.specs.append(Spec(rid, arrival, prompt_len, min(20, 32 - prompt_len), None))
    return sc


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swapped_requests_resume_without_recompute(prefix_caching: bool) -> None:
    """With room on the host, no position is ever computed twice."""
    run = SwapRun(_tight_scenario(prefix_caching=prefix_caching), Swapper("swap", SwapSpace(64)))
    run.run()
    assert run.num_swapped_out > 0 and run.num_fallbacks == 0 and not run.recomputed
    assert run.num_swapped_in == run.num_swapped_out
    assert max(run.fed.values()) == 1, "a swapped request recomputed a position"
    assert run.swapper.space.peak_used > 0


def test_full_host_pool_falls_back_to_recompute() -> None:
    """A host pool too small for any victim: every preemption recomputes, counted."""
    run = SwapRun(_tight_scenario(), Swapper("swap", SwapSpace(0)))
    run.run()
    assert run.num_fallbacks > 0 and run.num_fallbacks == run.sched.num_preemptions
    assert run.num_swapped_out == 0 and run.recomputed
    assert max(run.fed.values()) > 1, "recomputed requests feed positions again"


def test_abort_while_swapped_out_frees_host_slots() -> None:
    run = SwapRun(_tight_scenario(), Swapper("swap", SwapSpace(64)))
    run.run(abort_swapped_at=0)  # the first request seen swapped out is aborted there
    assert run.aborted_swapped == 1
    assert run.swapper.space.num_used == 0
