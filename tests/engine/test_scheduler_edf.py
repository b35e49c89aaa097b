"""The edf policy on the host scheduler, driven by a fake clock and the fake model of
test_scheduler_properties.py: the queue is in deadline order (late requests behind the ones
that can still make theirs), victims have the most slack, the starvation bound holds, and no
page leaks under random arrivals, aborts and preemption.

The clock advances `DT` seconds per step and stands still within one, as the policy's
injectable clock lets a test do; arrival times are on the same clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import EOS, expected_output, fake_token, prompt_for

from jaxcb.config import SchedulerConfig
from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.policies import EDFPolicy, make_policy
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.sampling_params import SamplingParams

DT = 1.0  # clock seconds per step


@dataclass
class Arrival:
    rid: int
    step: int
    prompt_len: int
    max_tokens: int
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    abort_step: int | None = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_request(a: Arrival, max_model_len: int) -> Request:
    max_tokens = min(a.max_tokens, max(1, max_model_len - a.prompt_len))
    return Request(
        request_id=str(a.rid),
        prompt_token_ids=prompt_for(a.rid, a.prompt_len),
        params=SamplingParams(max_tokens=max_tokens),
        seed=a.rid,
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        arrival_time=a.step * DT,
        ttft_target_ms=a.ttft_ms,
        tpot_target_ms=a.tpot_ms,
    )


class EDFRun:
    """Steps a scheduler with the edf policy; after every step checks the queue order, the
    admissions (the head, never skipped), each victim's slack, the starvation bound and the
    pool; at the end, every request's tokens."""

    def __init__(
        self,
        arrivals: list[Arrival],
        *,
        late_penalty_ms: float = 4000.0,
        page_size: int = 4,
        max_model_len: int = 48,
        num_pages: int = 64,
        max_num_seqs: int = 4,
        budget: int = 16,
        prefix_caching: bool = True,
        eos_every: int = 0,
    ) -> None:
        self.arrivals = sorted(arrivals, key=lambda a: (a.step, a.rid))
        self.max_model_len = max_model_len
        self.eos_every = eos_every
        self.clock = Clock()
        self.policy = make_policy("edf", edf_late_penalty_ms=late_penalty_ms, clock=self.clock)
        assert isinstance(self.policy, EDFPolicy)
        self.penalty = late_penalty_ms / 1000
        self.pool = PagePool(num_pages)
        self.sched = Scheduler(
            page_pool=self.pool,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            policy=self.policy,
            enable_prefix_caching=prefix_caching,
        )
        self.requests = {a.rid: make_request(a, max_model_len) for a in arrivals}
        self.admitted_at: dict[int, int] = {}  # rid -> step of its first admission
        self.admission_order: list[int] = []  # every admission, re-admissions too
        self.victims: list[Request] = []

    def run(self) -> EDFRun:
        pending = list(self.arrivals)
        aborts = {a.abort_step: [] for a in self.arrivals}
        for a in self.arrivals:
            aborts[a.abort_step].append(self.requests[a.rid])
        step = 0
        limit = (
            (pending[-1].step if pending else 0)
            + len(self.requests) * (self.max_model_len + 2) * 2
            + 20
        )
        while pending or self.sched.num_unfinished:
            self.clock.now = step * DT
            while pending and pending[0].step <= step:
                self.sched.add(self.requests[pending.pop(0).rid])
            for req in aborts.get(step, []):
                if not req.finished:
                    req.finish_reason = "abort"
                    self.sched.finish(req)
                    assert req.page_ids == [] and req.num_reserved_tokens == 0
            self.step(step)
            step += 1
            assert step < limit, "requests did not finish: something starves"
        self.check_final()
        return self

    def step(self, step: int) -> None:
        sched, policy, now = self.sched, self.policy, self.clock.now
        waiting_before = sorted(sched.waiting, key=lambda r: policy.key(r, now))
        running_before = list(sched.running)
        out = sched.schedule()

        keys = [policy.key(r, now) for r in sched.waiting]
        assert keys == sorted(keys), "the waiting queue is not in deadline order"
        admitted = [r for r in sched.running if r not in running_before]
        assert admitted == waiting_before[: len(admitted)], "admission skipped the head"
        for r in admitted:
            self.admitted_at.setdefault(int(r.request_id), step)
            self.admission_order.append(int(r.request_id))

        # Victims: the most slack among those still running (which had it when chosen).
        for v in out.preempted:
            self.victims.append(v)
            for r in sched.running:
                assert policy.slack(r, now) <= policy.slack(v, now), (
                    f"victim {v.request_id} had less slack than {r.request_id}"
                )

        # The bound: nothing admitted while X waits arrived after X's deadline + penalty;
        # with no deadline, X comes after every request with one, fcfs among the rest.
        for x in sched.waiting:
            if x in out.preempted:
                continue
            deadline = policy.deadline(x)
            for y in admitted:
                if math.isfinite(deadline):
                    assert y.arrival_time <= deadline + self.penalty, (
                        f"request {y.request_id} (arrived {y.arrival_time}) overtook "
                        f"{x.request_id} (deadline {deadline}, penalty {self.penalty})"
                    )
                else:
                    assert math.isfinite(policy.deadline(y)) or y.arrival_seq < x.arrival_seq

        sched.update_after_step(out)
        for chunk in out.chunks:
            req = chunk.request
            if chunk.samples:
                rid = int(req.request_id)
                req.append_token(fake_token(rid, req.num_tokens, self.eos_every))
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.check_stop_tokens(self.max_model_len)
                if req.finish_reason is not None:
                    sched.finish(req)
        self.pool.check_invariant(sched.owners())

    def check_final(self) -> None:
        assert self.pool.num_used == 0 and self.pool.num_free == self.pool.num_pages
        for rid, req in self.requests.items():
            assert req.status is RequestStatus.FINISHED
            want = expected_output(
                rid, req.num_prompt_tokens, req.max_tokens, self.max_model_len, self.eos_every
            )
            n = len(req.output_token_ids)
            assert req.output_token_ids == (want[:n] if req.finish_reason == "abort" else want)


# ---- properties -------------------------------------------------------------------------


@st.composite
def edf_arrivals(draw: st.DrawFn) -> list[Arrival]:
    n = draw(st.integers(1, 14))
    spread = draw(st.sampled_from([0, 4, 20]))
    targets = st.one_of(st.none(), st.sampled_from([500.0, 2000.0, 5000.0, 20000.0]))
    out = []
    for i in range(n):
        step = draw(st.integers(0, spread))
        abort = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 30)))
        out.append(
            Arrival(
                rid=i,
                step=step,
                prompt_len=draw(st.integers(1, 40)),
                max_tokens=draw(st.integers(1, 8)),
                ttft_ms=draw(targets),
                tpot_ms=draw(targets),
                abort_step=None if abort is None else step + abort,
            )
        )
    return out


@st.composite
def pools(draw: st.DrawFn) -> dict:
    page_size = draw(st.sampled_from([2, 4, 8]))
    pages_per_seq = math.ceil(48 / page_size)
    max_num_seqs = draw(st.integers(1, 5))
    return dict(
        page_size=page_size,
        # tight pools preempt; the engine guarantees one full-length sequence fits
        num_pages=pages_per_seq + draw(st.sampled_from([0, 1, 3, pages_per_seq * 4])),
        max_num_seqs=max_num_seqs,
        budget=draw(st.integers(max_num_seqs, max_num_seqs + 24)),
        prefix_caching=draw(st.booleans()),
        eos_every=draw(st.sampled_from([0, 0, 7])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edf_arrivals(), pools(), st.sampled_from([1000.0, 4000.0, 30000.0]))
def test_edf_order_victims_bound_and_pages(arrs: list[Arrival], pool: dict, penalty: float):
    EDFRun(arrs, late_penalty_ms=penalty, **pool).run()


# ---- targeted scenarios -----------------------------------------------------------------


def test_queue_is_in_deadline_order_and_untargeted_requests_go_last() -> None:
    # One slot, so each request runs alone (2 steps: prompt, then its last token).
    arrs = [
        Arrival(0, 0, 4, 2, ttft_ms=None),  # admitted at once: nothing else waits
        Arrival(1, 0, 4, 2, ttft_ms=None),
        Arrival(2, 0, 4, 2, ttft_ms=30000.0),
        Arrival(3, 0, 4, 2, ttft_ms=9000.0),
        Arrival(4, 1, 4, 2, ttft_ms=1000.0),  # deadline 2.0: the earliest
    ]
    run = EDFRun(arrs, max_num_seqs=1, budget=16, late_penalty_ms=60000.0).run()
    # step 0: 3 has the earliest deadline (9 s); at step 2, 4 (2 s); then 2, then the
    # untargeted ones in arrival order
    assert run.admission_order == [3, 4, 2, 0, 1]


def test_a_late_request_falls_behind_those_that_can_still_make_it() -> None:
    """When the slot frees at step 4, request 1 (deadline 2 s) is late: its key 2 + 3 = 5 s
    puts it behind request 2 (deadline 4.5 s, still on time) but ahead of request 3
    (5.5 s). At step 6 request 3 is late too (5.5 + 3 s), behind request 1."""
    arrs = [
        Arrival(0, 0, 4, 4),  # holds the only slot for steps 0-3
        Arrival(1, 1, 4, 2, ttft_ms=1000.0),
        Arrival(2, 2, 4, 2, ttft_ms=2500.0),
        Arrival(3, 3, 4, 2, ttft_ms=2500.0),
    ]
    run = EDFRun(arrs, max_num_seqs=1, budget=16, late_penalty_ms=3000.0)
    policy = run.policy
    assert policy.key(run.requests[1], 2.0) == (2.0, -1)  # on time: its deadline
    assert policy.key(run.requests[1], 2.5)[0] == 5.0  # late: deadline + penalty
    run.run()
    assert run.admission_order == [0, 2, 1, 3]


def test_victim_is_the_request_with_the_most_slack() -> None:
    """Two running requests; the one whose next token is due latest is preempted, an
    untargeted one (infinite slack) before either, the newest admitted among equals."""
    clock = Clock()
    policy = EDFPolicy(clock=clock)
    clock.now = 10.0

    def running(rid: int, ttft: float | None, tpot: float | None, out: int, first: float):
        r = make_request(Arrival(rid, 0, 4, 20, ttft, tpot), 48)
        for _ in range(out):
            r.append_token(7)
        r.metrics.first_token_time = first if out else None
        return r

    prefill = running(0, 12000.0, 100.0, 0, 0.0)  # slack 12 - 10 = 2
    tight = running(1, 500.0, 200.0, 10, 9.0)  # 9 + 0.2 * 10 - 10 = 1
    loose = running(2, 500.0, 1000.0, 5, 6.0)  # 6 + 1 * 5 - 10 = 1 (tie with tight)
    free = running(3, 500.0, None, 3, 2.0)  # no TPOT target: inf
    assert policy.slack(prefill, 10.0) == pytest.approx(2.0)
    assert policy.slack(tight, 10.0) == pytest.approx(1.0)
    assert policy.victim([prefill, tight, loose, free]) is free
    assert policy.victim([prefill, tight]) is prefill
    assert policy.victim([loose, tight]) is tight  # equal slack: the newest admitted
    assert policy.victim([tight, loose]) is loose


def test_scheduler_preempts_the_request_with_the_most_slack() -> None:
    """A pool of 12 pages (4 tokens each) and three requests growing in it: the first
    preemption takes the one without a TPOT target, not the newest admitted."""
    arrs = [
        Arrival(0, 0, 12, 30, ttft_ms=1000.0, tpot_ms=None),
        Arrival(1, 0, 12, 30, ttft_ms=1000.0, tpot_ms=500.0),
        Arrival(2, 0, 12, 30, ttft_ms=1000.0, tpot_ms=500.0),
    ]
    run = EDFRun(arrs, num_pages=12, max_num_seqs=3, budget=64).run()
    assert run.victims and run.victims[0].request_id == "0"


def _flood(num_short: int) -> list[Arrival]:
    """A short prompt with a 1 s TTFT target every step from step 0 (each holds the only
    slot for two steps, so the queue only grows), and at step 1 a long one with 2.5 s."""
    return [Arrival(0, 1, 40, 2, ttft_ms=2500.0)] + [
        Arrival(i, i - 1, 2, 2, ttft_ms=1000.0) for i in range(1, num_short)
    ]


@pytest.mark.parametrize("num_short", [60, 240])
def test_a_late_request_is_admitted_within_the_bound(num_short: int) -> None:
    """Request 0 (deadline 3.5 s) misses it behind shorts with earlier deadlines. With a
    10 s penalty only the shorts arriving before 13.5 s can go first (EDFRun checks that at
    every step): the first short after that is due at 16 s, and request 0 goes before it,
    however long the flood. A penalty beyond the flood's length keeps it waiting until the
    flood ends."""
    kw = dict(page_size=4, max_model_len=48, num_pages=64, max_num_seqs=1, budget=48)
    bounded = EDFRun(_flood(num_short), late_penalty_ms=10000.0, **kw).run()
    assert bounded.admitted_at[0] == 16
    starved = EDFRun(_flood(num_short), late_penalty_ms=1e9, **kw).run()
    assert starved.admitted_at[0] >= num_short - 2  # what the bounded penalty prevents


def test_reorder_sorts_only_when_a_request_turned_late() -> None:
    clock = Clock()
    policy = EDFPolicy(late_penalty_ms=10000.0, clock=clock)
    sched = Scheduler(
        page_pool=PagePool(8), page_size=4, max_num_seqs=1, max_num_batched_tokens=8, policy=policy
    )
    a = make_request(Arrival(0, 0, 4, 2, ttft_ms=1000.0), 48)
    b = make_request(Arrival(1, 0, 4, 2, ttft_ms=5000.0), 48)
    sched.add(a)
    sched.add(b)
    assert list(sched.waiting) == [a, b]
    clock.now = 0.9
    policy.reorder(sched.waiting)
    assert list(sched.waiting) == [a, b]
    clock.now = 1.5  # a is late: 1 + 10 s, behind b's 5 s
    policy.reorder(sched.waiting)
    assert list(sched.waiting) == [b, a]


def test_edf_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="late penalty must be > 0"):
        make_policy("edf", edf_late_penalty_ms=0)
    with pytest.raises(ValueError, match="ttft_target_ms must be > 0"):
        SchedulerConfig(ttft_target_ms=0)
    with pytest.raises(ValueError, match="tpot_target_ms must be > 0"):
        SchedulerConfig(tpot_target_ms=-5)
    with pytest.raises(ValueError, match="edf_late_penalty_ms must be > 0"):
        SchedulerConfig(edf_late_penalty_ms=0)
    with pytest.raises(ValueError, match=r"SamplingParams.ttft_target_ms must be > 0"):
        SamplingParams(ttft_target_ms=0)
    with pytest.raises(ValueError, match=r"SamplingParams.tpot_target_ms must be > 0"):
        SamplingParams(tpot_target_ms=float("nan"))
