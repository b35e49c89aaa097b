"""Admission modes on the host scheduler (greedy | reserve | predicted), with the fake model
of test_scheduler_properties.py under random arrivals, aborts, prefix sharing and tight
pools: pages never leak, nothing deadlocks, `reserve` never preempts, every admission keeps
its promise and stops only for a reason, and `predicted` preempts less than `greedy` where
output lengths vary. Then the engine around it: latency targets reach the request, and
stats() reports preemption's recomputed tokens, admission's idle pages and the prediction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import FakeRunnerBase, fake_engine_info
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import (
    EOS,
    Scenario,
    Spec,
    expected_output,
    fake_token,
    make_request,
    scenarios,
)

from jaxcb.config import EngineConfig, SchedulerConfig
from jaxcb.engine.interface import StepResult
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.page_pool import PagePool, hash_page
from jaxcb.engine.sched.policies import OutputLengths, reserved_tokens
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.sampling_params import SamplingParams


def nearest_rank(lengths: list[int], q: float) -> int:
    ordered = sorted(lengths)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


class AdmissionRun:
    """Steps a scenario under one admission mode and checks, after every step: the pool,
    admissions (the promise each was given, and a reason whenever the head stays waiting),
    `reserve`'s promise account (free pages always cover it, so it never preempts), the
    recomputed-token count, and the output length prediction."""

    def __init__(self, sc: Scenario, admission: str, quantile: float = 0.9) -> None:
        self.sc, self.admission, self.quantile = sc, admission, quantile
        self.pool = PagePool(sc.num_pages)
        self.sched = Scheduler(
            page_pool=self.pool,
            page_size=sc.page_size,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            enable_prefix_caching=sc.prefix_caching,
            long_prefill_token_threshold=sc.threshold,
            watermark_pages=sc.watermark_pages,
            admission=admission,
            admission_quantile=quantile,
        )
        self.requests = {s.rid: make_request(s) for s in sc.specs}
        self.finished_lengths: list[int] = []
        self.preemptions = 0
        self.recomputed = 0
        self.steps = 0

    def run(self) -> AdmissionRun:
        sc = self.sc
        last_arrival = max(s.arrival_step for s in sc.specs)
        max_steps = last_arrival + len(sc.specs) * (sc.max_model_len + 2) * 2 + 10
        for step in range(max_steps):
            for s in sc.specs:
                if s.arrival_step == step:
                    self.sched.add(self.requests[s.rid])
            for s in sc.specs:
                req = self.requests[s.rid]
                if s.abort_step == step and not req.finished:
                    req.finish_reason = "abort"
                    self.sched.finish(req)  # an abort is not an observed output length
                    assert req.page_ids == [] and req.num_reserved_tokens == 0
                    self.check_between_steps()
            if step >= last_arrival and all(r.finished for r in self.requests.values()):
                break
            self.step()
        else:
            pytest.fail(f"{self.admission}: not all requests finished within {max_steps} steps")
        self.check_final()
        return self

    def promise(self, req: Request, prediction: int | None) -> int:
        """The K/V positions a request is promised pages for, computed here from scratch."""
        if self.admission == "greedy":
            return 0
        output = req.max_tokens
        if self.admission == "predicted" and prediction is not None:
            output = min(output, prediction)
        return max(req.num_prompt_tokens + output - 1, req.num_tokens)

    def cached_prefix_pages(self, req: Request) -> list[int]:
        ps, parent, pages = self.sc.page_size, None, []
        if not self.sc.prefix_caching:
            return []
        for i in range((req.num_tokens - 1) // ps):
            parent = hash_page(parent, req.token_ids[i * ps : (i + 1) * ps])
            page = self.pool.lookup(parent)
            if page is None:
                break
            pages.append(page)
        return pages

    def step(self) -> None:
        sched, sc, ps = self.sched, self.sc, self.sc.page_size
        self.steps += 1
        prediction = sched.predicted_output_len
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        computed_before = {id(r): r.num_computed_tokens for r in self.requests.values()}

        out = sched.schedule()
        self.pool.check_invariant(sched.owners())
        self.preemptions += len(out.preempted)
        dropped = sum(computed_before[id(v)] for v in out.preempted)
        assert out.num_recomputed_tokens == dropped
        self.recomputed += dropped
        assert out.admitted_idle_pages == sched.admitted_idle_pages
        assert out.predicted_output_len == prediction

        admitted = [r for r in sched.running if r not in running_before]
        assert admitted == waiting_before[: len(admitted)], "admission is not fcfs"
        if waiting_before and not running_before:
            assert admitted, "nothing runs, yet the head was not admitted: a deadlock"
        for r in admitted:
            assert r.num_reserved_tokens == self.promise(r, prediction)

        if self.admission == "reserve":
            assert not out.preempted, "reserve admission preempted"
            assert self.pool.num_free >= sched.admitted_idle_pages
        if self.admission == "greedy":
            assert sched.admitted_idle_pages == 0

        # Admission stops only for a reason: budget, max_num_seqs, or pages for the head.
        if sched.waiting and not out.preempted and sched.running:
            head = sched.waiting[0]
            left = sc.max_num_batched_tokens - out.num_tokens
            hits = self.cached_prefix_pages(head)
            evictable = sum(self.pool.is_evictable(p) for p in hits)
            if self.admission == "greedy":
                n = min(head.num_tokens - len(hits) * ps, max(left, 1), sc.threshold or left)
                need = math.ceil((len(hits) * ps + n) / ps) - len(hits) + evictable
                need += sc.watermark_pages
                free = self.pool.num_free
            else:
                need = math.ceil(self.promise(head, prediction) / ps) - len(hits) + evictable
                need += sc.watermark_pages if self.admission == "predicted" else 0
                free = self.pool.num_free - sched.admitted_idle_pages
            assert left == 0 or len(sched.running) == sc.max_num_seqs or free < need, (
                "admission stopped for no reason"
            )

        sched.update_after_step(out)
        for chunk in out.chunks:
            req = chunk.request
            if not chunk.samples:
                continue
            rid = int(req.request_id)
            req.append_token(fake_token(rid, req.num_tokens, sc.eos_every))
            req.check_stop_tokens(sc.max_model_len)
            if req.finish_reason is not None:
                self.finished_lengths.append(len(req.output_token_ids))
                sched.finish(req)
        self.check_between_steps()

    def check_between_steps(self) -> None:
        sched = self.sched
        self.pool.check_invariant(sched.owners())
        for r in sched.waiting:
            assert r.num_reserved_tokens == 0 and r.page_ids == []
        recent = self.finished_lengths[-1000:]
        want = nearest_rank(recent, self.quantile) if recent else None
        assert sched.predicted_output_len == want
        if self.admission == "reserve":
            assert self.pool.num_free >= sched.admitted_idle_pages

    def check_final(self) -> None:
        sc = self.sc
        assert self.pool.num_free == sc.num_pages and self.pool.num_used == 0
        assert self.sched.admitted_idle_pages == 0
        assert self.sched.num_preemptions == self.preemptions
        for s in sc.specs:
            req = self.requests[s.rid]
            want = expected_output(
                s.rid, s.prompt_len, s.max_tokens, sc.max_model_len, sc.eos_every
            )
            assert req.status is RequestStatus.FINISHED
            n = len(req.output_token_ids)
            assert req.output_token_ids == (want[:n] if req.finish_reason == "abort" else want)


# ---- properties -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenarios(),
    st.sampled_from(["greedy", "reserve", "predicted"]),
    st.sampled_from([0.5, 0.9, 1.0]),
)
def test_admission_modes_never_leak_deadlock_or_break_promises(
    sc: Scenario, admission: str, quantile: float
) -> None:
    AdmissionRun(sc, admission, quantile).run()


# ---- targeted scenarios -----------------------------------------------------------------


def _scenario(
    requests: list[tuple[int, int, int]],
    *,
    num_pages: int,
    page_size: int = 2,
    max_model_len: int = 32,
    max_num_seqs: int = 4,
    budget: int = 8,
    eos_every: int = 0,
) -> Scenario:
    sc = Scenario(page_size, max_model_len, num_pages, max_num_seqs, budget, eos_every)
    for rid, (arrival, prompt_len, max_tokens) in enumerate(requests):
        room = max(1, max_model_len - prompt_len)
        sc.specs.append(Spec(rid, arrival, prompt_len, min(max_tokens, room), None))
    return sc


def test_reserve_never_preempts_where_greedy_does() -> None:
    """A pool of one max-length sequence: greedy admits everyone and preempts; reserve
    admits what it can hold to the end, and the tokens are the same."""
    reqs = [(0, 5, 20), (0, 7, 20), (1, 3, 20), (2, 9, 20), (2, 2, 20)]
    greedy = AdmissionRun(_scenario(reqs, num_pages=16), "greedy").run()
    reserve = AdmissionRun(_scenario(reqs, num_pages=16), "reserve").run()
    assert greedy.preemptions > 0 and greedy.recomputed > 0
    assert reserve.preemptions == 0 and reserve.recomputed == 0
    for rid in range(len(reqs)):
        assert greedy.requests[rid].output_token_ids == reserve.requests[rid].output_token_ids


def test_predicted_preempts_less_than_greedy_when_output_lengths_vary() -> None:
    """Outputs end at EOS after about 10 tokens on average (a tail to 28; max_tokens 40), in
    a pool of about a third of the working set: greedy over-admits and preempts; predicted
    reserves a quantile of the lengths seen so far and preempts far less. The quantile is
    the trade: 0.9 all but never preempts but runs fewer requests at once (more steps);
    0.5 runs nearly as many as greedy."""
    rng = np.random.default_rng(0)
    reqs = [(int(i // 2), int(rng.integers(4, 20)), 40) for i in range(60)]
    kw = dict(num_pages=24, page_size=4, max_model_len=64, max_num_seqs=8, budget=32)
    greedy = AdmissionRun(_scenario(reqs, eos_every=11, **kw), "greedy").run()
    high = AdmissionRun(_scenario(reqs, eos_every=11, **kw), "predicted", 0.9).run()
    median = AdmissionRun(_scenario(reqs, eos_every=11, **kw), "predicted", 0.5).run()
    reserve = AdmissionRun(_scenario(reqs, eos_every=11, **kw), "reserve").run()
    assert greedy.preemptions >= 10
    assert high.preemptions <= greedy.preemptions / 3 and high.recomputed < greedy.recomputed
    assert median.preemptions < greedy.preemptions / 2
    assert median.steps <= 1.25 * greedy.steps < high.steps
    assert reserve.preemptions == 0


def test_a_promise_the_pool_cannot_hold_waits_then_runs_alone() -> None:
    """16 free pages of 2 tokens. A runs (promise 20 tokens: 10 pages); B's promise (14
    pages) does not fit beside it, so B waits, not deadlocked: once A is gone, B runs
    alone on its first chunk, though the pool cannot hold its whole promise (C, which
    would fit, waits behind it: the head is never skipped)."""
    pool = PagePool(16)
    sched = Scheduler(
        page_pool=pool, page_size=2, max_num_seqs=4, max_num_batched_tokens=64, admission="reserve"
    )
    a = make_request(Spec(0, 0, 10, 11, None))
    b = make_request(Spec(1, 0, 8, 30, None))  # promise 37 tokens: 19 pages > 16
    c = make_request(Spec(2, 0, 2, 2, None))
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    assert a.num_reserved_tokens == 20 and sched.admitted_idle_pages == 10 - 5
    a.finish_reason = "abort"
    sched.finish(a)  # an abort frees its pages and its promise
    assert pool.num_free == 16 and sched.admitted_idle_pages == 0
    sched.schedule()
    assert sched.running == [b] and list(sched.waiting) == [c]
    assert sched.admitted_idle_pages == 19 - 4 > pool.num_free  # nothing else gets in
    sched.finish(b)
    sched.finish(c)
    assert pool.num_free == 16


def test_output_lengths_quantile_window_and_what_counts() -> None:
    lengths = OutputLengths(0.9, window=4)
    assert lengths.prediction is None
    for n, want in [(5, 5), (1, 5), (9, 9), (2, 9), (3, 9), (4, 9), (6, 6), (7, 7)]:
        lengths.observe(n)
        assert lengths.prediction == want  # of the last four at most
    median = OutputLengths(0.5)
    for n in (10, 20, 30, 40):
        median.observe(n)
    assert median.prediction == 20
    # The scheduler observes stop and length, not aborts or errors.
    sched = Scheduler(page_pool=PagePool(8), page_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    for rid, reason in enumerate(["stop", "abort", "error", "length"]):
        req = make_request(Spec(rid, 0, 2, 8, None))
        sched.add(req)
        req.output_token_ids = [7] * (rid + 1)
        req.finish_reason = reason
        sched.finish(req)
        sched.finish(req)  # twice: observed once
    assert sorted(sched.output_lengths._sorted) == [1, 4]
    assert sched.predicted_output_len == 4


def test_reserved_tokens_per_mode() -> None:
    req = make_request(Spec(0, 0, 10, 30, None))
    assert reserved_tokens("greedy", req, 5) == 0
    assert reserved_tokens("reserve", req, 5) == 10 + 30 - 1
    assert reserved_tokens("predicted", req, 5) == 10 + 5 - 1
    assert reserved_tokens("predicted", req, None) == 10 + 30 - 1  # nothing finished yet
    assert reserved_tokens("predicted", req, 100) == 10 + 30 - 1
    req.append_token(7)
    for _ in range(8):
        req.append_token(7)
    assert reserved_tokens("predicted", req, 5) == req.num_tokens  # outgrew the prediction


def test_bad_admission_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="admission must be one of"):
        SchedulerConfig(admission="lazy")
    with pytest.raises(ValueError, match="admission_quantile must be in"):
        SchedulerConfig(admission_quantile=0)
    with pytest.raises(ValueError, match="admission must be one of"):
        Scheduler(
            page_pool=PagePool(4),
            page_size=4,
            max_num_seqs=1,
            max_num_batched_tokens=4,
            admission="lazy",
        )
    with pytest.raises(ValueError, match="admission_quantile must be in"):
        OutputLengths(1.5)


# ---- the engine around it ---------------------------------------------------------------


class FakeRunner(FakeRunnerBase):
    """The device side, faked: the token after position p of request r is a function of
    (r's prompt, p), EOS after `r`'s own output length."""

    def __init__(self, output_len: dict[int, int]) -> None:
        self.output_len = output_len  # first prompt token -> output tokens before EOS

    def execute(self, bucket: object, sched: SchedulerOutput) -> StepResult:
        tokens = []
        for chunk in sched.chunks:
            req = chunk.request
            done = len(req.output_token_ids) + 1 >= self.output_len[req.prompt_token_ids[0]]
            tokens.append(EOS if done else 3 + (chunk.end * 7) % 90)
        n = len(tokens)
        return StepResult(np.array(tokens, np.int32), np.zeros(n, np.float32), None, None)


def fake_engine(**flat: object) -> LLMEngine:
    config = EngineConfig.from_dict(
        model="fake", max_num_seqs=4, max_num_batched_tokens=32, page_size=4, **flat
    )
    info = fake_engine_info(config, max_model_len=64, token_buckets=(8, 16, 32))
    lengths = {10 + i: n for i, n in enumerate([3, 30, 4, 5, 2, 28, 6, 3, 4, 5])}
    return LLMEngine(
        config, runner=FakeRunner(lengths), info=info, tokenizer=None, eos_token_ids=[EOS]
    )


def run_to_end(engine: LLMEngine) -> list[dict]:
    """Ten requests of 12-token prompts; the stats after each step."""
    for i in range(10):
        engine.add_request(None, [10 + i] + [5] * 11, SamplingParams(max_tokens=40, temperature=0))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_page_invariant()
        seen.append(engine.stats())
    return seen


def test_latency_targets_reach_the_request_with_config_defaults() -> None:
    engine = fake_engine(num_pages=64, ttft_target_ms=800.0, tpot_target_ms=50.0)
    engine.add_request("own", [5, 6], SamplingParams(ttft_target_ms=250.0, n=2))
    engine.add_request("default", [5, 6], SamplingParams(tpot_target_ms=20))
    targets = {r.request_id: (r.ttft_target_ms, r.tpot_target_ms) for r in engine.scheduler.waiting}
    assert targets == {"own-0": (250.0, 50.0), "own-1": (250.0, 50.0), "default": (800.0, 20)}
    bare = fake_engine(num_pages=64)
    bare.add_request("none", [5, 6], SamplingParams())
    assert (bare.scheduler.waiting[0].ttft_target_ms, bare.scheduler.waiting[0].tpot_target_ms) == (
        None,
        None,
    )
    with pytest.raises(ValueError, match="ttft_target_ms must be > 0"):
        SamplingParams(ttft_target_ms=-1.0)


@pytest.mark.parametrize("admission", ["greedy", "reserve", "predicted"])
def test_stats_report_recomputed_tokens_idle_pages_and_the_prediction(admission: str) -> None:
    """A pool of 16 pages for ten requests of up to 12 + 40 tokens (13 pages each), four
    at a time: greedy preempts, the others hold pages idle for their promises."""
    engine = fake_engine(num_pages=16, admission=admission, watermark=0)
    seen = run_to_end(engine)
    final = seen[-1]
    for key in ("preemptions", "recomputed_tokens", "admitted_idle_pages", "predicted_output_len"):
        assert key in final
    assert final["admitted_idle_pages"] == 0 and engine.pool.num_used == 0
    # the 0.9 quantile of the ten output lengths (EOS included)
    assert final["predicted_output_len"] == 28
    if admission == "greedy":
        assert final["preemptions"] > 0 and final["recomputed_tokens"] > 0
        assert all(s["admitted_idle_pages"] == 0 for s in seen)
    else:
        assert max(s["admitted_idle_pages"] for s in seen) > 0
    if admission == "reserve":
        assert final["preemptions"] == 0 and final["recomputed_tokens"] == 0
