"""Scheduling policies on the host scheduler, with hypothesis: priority order, srpf with aging
(bounded overtaking: nothing starves), the long-prefill threshold and the watermark.

The same fake model as test_scheduler_properties.py: a request's tokens depend only on its id
and position, so whatever the policy does, every request must finish with the tokens it
would have produced alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import EOS, expected_output, fake_token, prompt_for

from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.policies import (
    POLICIES,
    FCFSPolicy,
    PriorityPolicy,
    SRPFPolicy,
    make_policy,
)
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.sampling_params import SamplingParams


@dataclass
class Arrival:
    rid: int
    step: int
    prompt_len: int
    max_tokens: int
    priority: int = 0


def make_request(a: Arrival, max_model_len: int) -> Request:
    max_tokens = min(a.max_tokens, max(1, max_model_len - a.prompt_len))
    return Request(
        request_id=str(a.rid),
        prompt_token_ids=prompt_for(a.rid, a.prompt_len),
        params=SamplingParams(max_tokens=max_tokens),
        seed=a.rid,
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        arrival_time=float(a.step),
        priority=a.priority,
    )


class PolicyRun:
    """Drives a scheduler with the fake model; records admissions and checks the policy's
    queue order and victim choice after every step."""

    def __init__(
        self,
        arrivals: list[Arrival],
        *,
        policy: str,
        page_size: int = 4,
        max_model_len: int = 48,
        num_pages: int = 64,
        max_num_seqs: int = 4,
        budget: int = 16,
        threshold: int = 0,
        watermark_pages: int = 0,
        srpf_aging: float = 4.0,
        prefix_caching: bool = True,
    ) -> None:
        self.arrivals = sorted(arrivals, key=lambda a: (a.step, a.rid))
        self.max_model_len = max_model_len
        self.threshold = threshold
        self.pool = PagePool(num_pages)
        self.policy = make_policy(policy, srpf_aging=srpf_aging)
        self.sched = Scheduler(
            page_pool=self.pool,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            policy=self.policy,
            enable_prefix_caching=prefix_caching,
            long_prefill_token_threshold=threshold,
            watermark_pages=watermark_pages,
        )
        self.requests = {a.rid: make_request(a, max_model_len) for a in arrivals}
        self.arrival_step = {a.rid: a.step for a in arrivals}
        self.admitted_at: dict[int, int] = {}  # rid -> step of its first admission
        self.admission_order: list[int] = []  # rids, every admission (re-admissions too)
        self.victims: list[tuple[Request, list[Request]]] = []  # (victim, running after)

    def key(self, req: Request) -> tuple:
        return self.policy.key(req) if hasattr(self.policy, "key") else (req.arrival_seq,)

    def run(self) -> PolicyRun:
        pending = list(self.arrivals)
        step = 0
        limit = (
            (pending[-1].step if pending else 0)
            + len(self.requests) * (self.max_model_len + 2) * 2
            + 20
        )
        while pending or self.sched.num_unfinished:
            while pending and pending[0].step <= step:
                self.sched.add(self.requests[pending.pop(0).rid])
            self.step(step)
            step += 1
            assert step < limit, "requests did not finish: something starves"
        self.check_final()
        return self

    def step(self, step: int) -> None:
        sched = self.sched
        waiting_before = list(sched.waiting)
        if isinstance(self.policy, PriorityPolicy | SRPFPolicy):
            keys = [self.key(r) for r in waiting_before]
            assert keys == sorted(keys), "the waiting queue is not in the policy's order"
        running_before = list(sched.running)
        out = sched.schedule()
        admitted = [r for r in sched.running if r not in running_before]
        # Admission takes the head of the queue, in order, never skipping it.
        assert admitted == waiting_before[: len(admitted)]
        for r in admitted:
            rid = int(r.request_id)
            self.admitted_at.setdefault(rid, step)
            self.admission_order.append(rid)
        for victim in out.preempted:
            self.victims.append((victim, list(sched.running)))
        if self.threshold:
            assert all(c.num_tokens <= self.threshold for c in out.chunks), "over the threshold"
        sched.update_after_step(out)
        for chunk in out.chunks:
            req = chunk.request
            if chunk.samples:
                rid = int(req.request_id)
                req.append_token(fake_token(rid, req.num_tokens, 0))
                req.check_stop_tokens(self.max_model_len)
                if req.finish_reason is not None:
                    sched.finish(req)
        self.pool.check_invariant(sched.owners())

    def check_final(self) -> None:
        assert self.pool.num_used == 0 and self.pool.num_free == self.pool.num_pages
        for rid, req in self.requests.items():
            assert req.status is RequestStatus.FINISHED
            want = expected_output(
                rid, req.num_prompt_tokens, req.max_tokens, self.max_model_len, 0
            )
            assert req.output_token_ids == want


@st.composite
def arrivals(draw: st.DrawFn, *, priorities: bool = False, max_prompt: int = 40) -> list[Arrival]:
    n = draw(st.integers(1, 14))
    spread = draw(st.sampled_from([0, 4, 20]))
    return [
        Arrival(
            rid=i,
            step=draw(st.integers(0, spread)),
            prompt_len=draw(st.integers(1, max_prompt)),
            max_tokens=draw(st.integers(1, 8)),
            priority=draw(st.integers(-2, 2)) if priorities else 0,
        )
        for i in range(n)
    ]


@st.composite
def pools(draw: st.DrawFn) -> dict:
    page_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = 48
    pages_per_seq = math.ceil(max_model_len / page_size)
    max_num_seqs = draw(st.integers(1, 5))
    return dict(
        page_size=page_size,
        max_model_len=max_model_len,
        # tight pools preempt; the engine guarantees one full-length sequence fits
        num_pages=pages_per_seq + draw(st.sampled_from([0, 1, 3, pages_per_seq * 4])),
        max_num_seqs=max_num_seqs,
        budget=draw(st.integers(max_num_seqs, max_num_seqs + 24)),
        threshold=draw(st.sampled_from([0, 0, 1, 3, 8])),
        prefix_caching=draw(st.booleans()),
    )


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- priority ---------------------------------------------------------------------------


@SETTINGS
@given(arrivals(priorities=True), pools())
def test_priority_order_and_victims(arrs: list[Arrival], pool: dict) -> None:
    run = PolicyRun(arrs, policy="priority", **pool).run()
    for victim, running_after in run.victims:
        # the lowest priority (highest value) is preempted first
        assert all(r.priority <= victim.priority for r in running_after)
    # A request admitted while another waited never had a worse (priority, arrival) key
    # than it: checked per step through the sorted queue; here across the whole run.
    for rid, step in run.admitted_at.items():
        mine = run.requests[rid]
        for other_rid, other in run.requests.items():
            if run.arrival_step[other_rid] <= run.arrival_step[rid] and (
                other.priority,
                other.arrival_seq,
            ) < (mine.priority, mine.arrival_seq):
                # `other` was waiting (or done) whenever `mine` could go: it went no later
                assert run.admitted_at[other_rid] <= step


def test_priority_admits_lower_values_first_and_preempts_the_lowest() -> None:
    arrs = [
        Arrival(0, 0, 8, 30, priority=5),  # running first, low priority
        Arrival(1, 1, 4, 30, priority=1),
        Arrival(2, 1, 4, 30, priority=-1),
        Arrival(3, 1, 4, 30, priority=1),
    ]
    run = PolicyRun(
        arrs, policy="priority", page_size=4, num_pages=12, max_num_seqs=4, budget=32
    ).run()
    assert run.admission_order[:4] == [0, 2, 1, 3]
    assert run.victims, "this pool is meant to preempt"
    assert run.victims[0][0].request_id == "0"  # the lowest priority goes first


# ---- srpf with aging ----------------------------------------------------------------------


@SETTINGS
@given(arrivals(), pools(), st.sampled_from([0.5, 2.0, 8.0]))
def test_srpf_with_aging_bounds_overtaking(arrs: list[Arrival], pool: dict, aging: float) -> None:
    """No request that arrives more than `remaining / aging` steps after X is admitted
    before X: only finitely many can overtake it, however long the stream — X never
    starves. (Keys only grow on preemption, so the bound uses X's key at arrival.)"""
    run = PolicyRun(arrs, policy="srpf", srpf_aging=aging, **pool).run()
    for rid, step in run.admitted_at.items():
        x = run.requests[rid]
        horizon = run.arrival_step[rid] + x.num_prompt_tokens / aging
        for other_rid, other_step in run.admitted_at.items():
            if run.arrival_step[other_rid] > horizon:
                assert other_step >= step, (
                    f"request {other_rid} (arrived {run.arrival_step[other_rid]}) overtook "
                    f"request {rid} (arrived {run.arrival_step[rid]}, {x.num_prompt_tokens} "
                    f"tokens, aging {aging})"
                )


def _flood(long_len: int, num_short: int) -> list[Arrival]:
    """A short prompt every step from step 0, and one long prompt at step 1."""
    return [Arrival(0, 1, long_len, 2)] + [Arrival(i, i - 1, 2, 2) for i in range(1, num_short)]


@pytest.mark.parametrize("num_short", [60, 240])
def test_srpf_aging_admits_a_long_prompt_in_bounded_time(num_short: int) -> None:
    """One slot; short prompts arrive once a step and hold it two steps each, so the queue
    only grows. Pure shortest-first keeps the long prompt waiting for the whole flood. With
    aging 2, only the shorts arriving within 40 / 2 steps of it go first (two steps each):
    its wait is bounded, however long the flood lasts."""
    kw = dict(page_size=4, max_model_len=48, num_pages=64, max_num_seqs=1, budget=48)
    aged = PolicyRun(_flood(40, num_short), policy="srpf", srpf_aging=2.0, **kw).run()
    assert aged.admitted_at[0] <= 2 * (40 / 2 + 2)
    starved = PolicyRun(_flood(40, num_short), policy="srpf", srpf_aging=1e-6, **kw).run()
    assert starved.admitted_at[0] >= num_short  # what aging prevents
    fcfs = PolicyRun(_flood(40, num_short), policy="fcfs", **kw).run()
    assert fcfs.admitted_at[0] <= 2


def test_srpf_prefers_short_prompts() -> None:
    arrs = [Arrival(0, 0, 4, 2), Arrival(1, 1, 40, 2), Arrival(2, 1, 20, 2), Arrival(3, 1, 3, 2)]
    run = PolicyRun(
        arrs, policy="srpf", srpf_aging=0.01, max_num_seqs=1, budget=48, num_pages=64
    ).run()
    assert run.admission_order == [0, 3, 2, 1]


# ---- long-prefill threshold and watermark ----------------------------------------------


@SETTINGS
@given(arrivals(max_prompt=48), pools(), st.sampled_from(["fcfs", "srpf"]))
def test_long_prefill_threshold_is_respected(arrs: list[Arrival], pool: dict, policy: str) -> None:
    PolicyRun(arrs, policy=policy, **{**pool, "threshold": pool["threshold"] or 5}).run()


def test_threshold_lets_short_prompts_in_beside_a_huge_one() -> None:
    arrs = [Arrival(0, 0, 44, 2), Arrival(1, 0, 3, 2), Arrival(2, 0, 3, 2)]
    kw = dict(page_size=4, num_pages=64, max_num_seqs=4, budget=16)
    capped = PolicyRun(arrs, policy="fcfs", threshold=8, **kw).run()
    hog = PolicyRun(arrs, policy="fcfs", **kw).run()
    assert capped.admitted_at[1] == capped.admitted_at[2] == 0  # same step as the long one
    assert hog.admitted_at[1] > 0  # without a cap the long prompt took the whole budget


def test_watermark_holds_pages_back_for_running_requests() -> None:
    # 12 pages of 4 tokens; each request needs 3 pages for its 12-token prompt.
    arrs = [Arrival(i, 0, 12, 20) for i in range(4)]
    kw = dict(page_size=4, max_model_len=48, num_pages=12, max_num_seqs=4, budget=64)
    plain = PolicyRun(arrs, policy="fcfs", **kw)
    plain.sched.add(plain.requests[0])
    for r in range(1, 4):
        plain.sched.add(plain.requests[r])
    plain.sched.schedule()
    assert len(plain.sched.running) == 4 and plain.pool.num_free == 0
    held = PolicyRun(arrs, policy="fcfs", watermark_pages=3, **kw)
    for r in range(4):
        held.sched.add(held.requests[r])
    held.sched.schedule()
    assert len(held.sched.running) == 3 and held.pool.num_free == 3
    # the watermark never blocks the only request: a lone full-length one is admitted
    lone = PolicyRun([Arrival(0, 0, 47, 1)], policy="fcfs", watermark_pages=3, **kw).run()
    assert lone.admitted_at[0] == 0


def test_a_new_policy_is_one_class_and_the_config_can_name_it(monkeypatch) -> None:
    """Adding a policy touches policies.py alone: the subclass registers its name, the
    config accepts it and the scheduler runs it (here: last come, first served)."""
    monkeypatch.setattr("jaxcb.engine.sched.policies.POLICIES", dict(POLICIES))

    class LCFS(FCFSPolicy):
        name = "test-lcfs"

        def enqueue(self, waiting, request, *, preempted) -> None:
            waiting.appendleft(request)

    from jaxcb.config import EngineConfig
    from jaxcb.engine.sched.factory import check_scheduler_config

    config = EngineConfig.from_dict(None, scheduling_policy="test-lcfs")
    check_scheduler_config(config)
    run = PolicyRun([Arrival(i, 0, 4, 2) for i in range(3)], policy="test-lcfs", max_num_seqs=1)
    run.run()
    assert sorted(run.admitted_at, key=run.admitted_at.get) == [2, 1, 0]
    assert "test-lcfs" not in POLICIES  # the registry is back as it was


def test_build_engine_rejects_an_unknown_policy_before_loading_anything(monkeypatch) -> None:
    from jaxcb import build
    from jaxcb.config import EngineConfig

    def must_not_run(*args, **kwargs):
        raise AssertionError("built the runner for a config that names no policy")

    monkeypatch.setattr(build, "build_runner", must_not_run)
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', 'prio"):
        build.build_engine(EngineConfig.from_dict(None, scheduling_policy="lifo"))


def test_unknown_policy_and_bad_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="aging must be > 0"):
        make_policy("srpf", srpf_aging=0)
    with pytest.raises(ValueError, match="watermark_pages"):
        Scheduler(
            page_pool=PagePool(4),
            page_size=4,
            max_num_seqs=1,
            max_num_batched_tokens=4,
            watermark_pages=4,
        )
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(
            page_pool=PagePool(4),
            page_size=4,
            max_num_seqs=1,
            max_num_batched_tokens=4,
            long_prefill_token_threshold=-1,
        )
