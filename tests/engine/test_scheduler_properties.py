"""Property tests of the host-side Scheduler + PagePool, driven by a fake model (no jax).

The fake model's next token depends only on (request id, position), so a request that is
preempted and recomputed must produce exactly the tokens it would have produced without
preemption, and every token fed at a position must always be the same token.

A fake KV cache checks the prefix cache: each slot holds the token prefix whose K/V it
stores (written when a token is fed), and every slot a step reads must hold exactly the
reading request's own prefix. Prompts share prefixes across requests, so pages are shared,
evicted and re-used; a page is never written while another request holds it.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.page_pool import PagePool, hash_page
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.sampling_params import SamplingParams

EOS = 2


def fake_token(rid: int, position: int, eos_every: int) -> int:
    """The token the fake model samples for request `rid` at `position` (deterministic)."""
    h = (rid * 1_000_003 + position * 7_919 + 12_345) % 65_521
    if eos_every and h % eos_every == 0:
        return EOS
    return 3 + h % 250


def prompt_for(rid: int, length: int, family: int = -1, shared: int = 0) -> list[int]:
    """A prompt of `length` tokens; its first `shared` come from the family's common prefix."""
    common = [3 + (family * 53 + i * 29) % 250 for i in range(shared)]
    own = [3 + (rid * 31 + i * 17) % 250 for i in range(length - len(common))]
    return (common + own)[:length]


def expected_output(
    rid: int, prompt_len: int, max_tokens: int, max_model_len: int, eos_every: int
) -> list[int]:
    """What a request generates with no batching and no preemption at all."""
    out: list[int] = []
    while True:
        tok = fake_token(rid, prompt_len + len(out), eos_every)
        out.append(tok)
        if tok == EOS or len(out) >= max_tokens or prompt_len + len(out) >= max_model_len:
            return out


@dataclass
class Spec:
    rid: int
    arrival_step: int
    prompt_len: int
    max_tokens: int  # already clamped as LLMEngine.add_request does
    abort_step: int | None
    family: int = -1  # requests of a family share the first `shared` prompt tokens
    shared: int = 0


@dataclass
class Scenario:
    page_size: int
    max_model_len: int
    num_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_every: int
    specs: list[Spec] = field(default_factory=list)
    prefix_caching: bool = False
    threshold: int = 0  # long_prefill_token_threshold; 0: none
    watermark_pages: int = 0


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    max_model_len = draw(st.integers(2, 48))
    pages_per_seq = math.ceil(max_model_len / page_size)
    # The engine's rule: the pool holds at least one max-length sequence. Tight pools
    # (a page or two over that) are where preemption happens.
    extra = draw(st.one_of(st.integers(0, 2), st.integers(0, 2 * pages_per_seq + 2)))
    num_pages = pages_per_seq + extra
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, max_num_seqs + 40))
    sc = Scenario(
        page_size=page_size,
        max_model_len=max_model_len,
        num_pages=num_pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        eos_every=draw(st.sampled_from([0, 0, 7, 23])),
        prefix_caching=draw(st.sampled_from([True, True, False])),
        threshold=draw(st.one_of(st.just(0), st.just(0), st.integers(1, 12))),
        watermark_pages=draw(st.one_of(st.just(0), st.just(0), st.integers(0, 3))),
    )
    sc.watermark_pages = min(sc.watermark_pages, num_pages - 1)
    num_families = draw(st.sampled_from([0, 1, 1, 2, 3]))
    num_requests = draw(st.integers(1, 10))
    spread = draw(st.sampled_from([0, 5, 30]))  # all at once, bursty, trickling in
    arrivals = sorted(
        draw(st.lists(st.integers(0, spread), min_size=num_requests, max_size=num_requests))
    )
    for rid, arrival in enumerate(arrivals):
        prompt_len = draw(st.integers(1, max_model_len))
        room = max(1, max_model_len - prompt_len)
        max_tokens = min(draw(st.integers(1, 40)), room)
        abort = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 40)))
        abort_step = None if abort is None else arrival + abort
        family = draw(st.integers(-1, num_families - 1)) if num_families else -1
        shared = draw(st.sampled_from([prompt_len, prompt_len, prompt_len // 2, prompt_len - 1]))
        shared = max(shared, 0) if family >= 0 else 0
        sc.specs.append(Spec(rid, arrival, prompt_len, max_tokens, abort_step, family, shared))
    return sc


def make_request(spec: Spec) -> Request:
    return Request(
        request_id=str(spec.rid),
        prompt_token_ids=prompt_for(spec.rid, spec.prompt_len, spec.family, spec.shared),
        params=SamplingParams(max_tokens=spec.max_tokens),
        seed=spec.rid,
        max_tokens=spec.max_tokens,
        eos_token_ids=frozenset({EOS}),
        arrival_time=float(spec.arrival_step),
    )


def run_fake_kv_cache(
    kv: dict[int, tuple[int, ...]], sched: Scheduler, out: SchedulerOutput, page_size: int
) -> None:
    """What the device step does to the cache `kv` (KV slot -> the token prefix its K/V
    encode): read every earlier slot of each chunk, write the chunk's own slots. A read of
    another prefix, or a write into a shared page, fails."""
    holders = Counter(p for pages in sched.owners() for p in pages)
    for chunk in out.chunks:
        req = chunk.request
        tokens = tuple(req.token_ids)
        for pos in range(chunk.end):
            page = req.page_ids[pos // page_size]
            slot = page * page_size + pos % page_size
            if pos < chunk.start:
                assert kv.get(slot) == tokens[: pos + 1], (
                    f"request {req.request_id} reads position {pos} from page {page}, "
                    f"which holds another prefix"
                )
            else:
                assert holders[page] == 1, f"page {page} written while shared"
                kv[slot] = tokens[: pos + 1]


class Harness:
    """Runs a scenario step by step and checks every scheduler property after each step."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.pool = PagePool(sc.num_pages)
        self.sched = Scheduler(
            page_pool=self.pool,
            page_size=sc.page_size,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            enable_prefix_caching=sc.prefix_caching,
            long_prefill_token_threshold=sc.threshold,
            watermark_pages=sc.watermark_pages,
        )
        self.requests = {s.rid: make_request(s) for s in sc.specs}
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix its K/V encode
        self.hit_tokens = 0  # prefix cache hits, counted independently of the scheduler
        self.rid_of = {id(r): int(r.request_id) for r in self.requests.values()}
        self.expected_waiting: deque[Request] = deque()  # FCFS model of the waiting queue
        self.admit_seq: dict[int, int] = {}  # id(request) -> when it was last admitted
        self.num_admissions = 0
        self.fed: dict[tuple[int, int], int] = {}  # (rid, position) -> token fed there
        self.sampled: set[tuple[int, int]] = set()  # (rid, position) sampled already
        self.total_preemptions = 0
        self.steps = 0

    # ---- the fake engine loop -----------------------------------------------------------

    def run(self) -> None:
        sc = self.sc
        last_arrival = max(s.arrival_step for s in sc.specs)
        # Once it is the oldest running request, a request finishes within
        # max_model_len + 1 steps (it can no longer be preempted and gets >= 1 token per step).
        max_steps = last_arrival + len(sc.specs) * (sc.max_model_len + 2) + 10
        for step in range(max_steps):
            for s in sc.specs:
                if s.arrival_step == step:
                    self.sched.add(self.requests[s.rid])
                    self.expected_waiting.append(self.requests[s.rid])
            for s in sc.specs:
                if s.abort_step == step:
                    self.abort(self.requests[s.rid])
            if step >= last_arrival and all(r.finished for r in self.requests.values()):
                break
            self.step()
        else:
            pytest.fail(f"not all requests finished within {max_steps} steps")
        self.check_final()

    def abort(self, req: Request) -> None:
        if req.finished:
            return
        if req in self.expected_waiting:
            self.expected_waiting.remove(req)
        req.finish_reason = "abort"
        self.sched.finish(req)
        assert req.status is RequestStatus.FINISHED
        assert req.page_ids == []
        self.check_between_steps()

    def step(self) -> None:
        sched, sc = self.sched, self.sc
        self.steps += 1
        running_before = list(sched.running)
        decoding_before = [r for r in running_before if r.is_decoding]
        waiting_before = list(sched.waiting)
        computed_before = {id(r): r.num_computed_tokens for r in self.requests.values()}
        assert waiting_before == list(self.expected_waiting), "waiting queue is not FCFS"

        out = sched.schedule()
        self.check_schedule(out, running_before, decoding_before, waiting_before, computed_before)

        self.run_fake_kv_cache(out)
        sched.update_after_step(out)
        for chunk in out.chunks:
            req = chunk.request
            rid = self.rid_of[id(req)]
            for pos in range(chunk.start, chunk.end):
                tok = req.token_ids[pos]
                assert self.fed.setdefault((rid, pos), tok) == tok, (
                    f"request {rid} fed {tok} at position {pos}, earlier {self.fed[(rid, pos)]}"
                )
                want = (
                    req.prompt_token_ids[pos]
                    if pos < req.num_prompt_tokens
                    else fake_token(rid, pos, sc.eos_every)
                )
                assert tok == want, f"request {rid} position {pos}: fed {tok}, expected {want}"
            if not chunk.samples:
                continue
            pos = req.num_tokens
            assert (rid, pos) not in self.sampled, f"request {rid} sampled position {pos} twice"
            self.sampled.add((rid, pos))
            req.append_token(fake_token(rid, pos, sc.eos_every))
            req.check_stop_tokens(sc.max_model_len)
            if req.finish_reason is not None:
                sched.finish(req)
        self.check_between_steps()

    def run_fake_kv_cache(self, out: SchedulerOutput) -> None:
        run_fake_kv_cache(self.kv, self.sched, out, self.sc.page_size)

    def cached_prefix_pages(self, req: Request) -> list[int]:
        """The pool's pages holding the request's leading full pages (at most all but the
        page of its last token), found with the pool's public lookup."""
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

    # ---- properties ---------------------------------------------------------------------

    def check_schedule(
        self,
        out: SchedulerOutput,
        running_before: list[Request],
        decoding_before: list[Request],
        waiting_before: list[Request],
        computed_before: dict[int, int],
    ) -> None:
        sched, sc, ps = self.sched, self.sc, self.sc.page_size
        budget = sc.max_num_batched_tokens
        chunk_reqs = [c.request for c in out.chunks]
        chunk_ids = {id(r) for r in chunk_reqs}
        preempted_ids = {id(r) for r in out.preempted}

        # Budget, sequence limit, uniqueness.
        assert 0 < out.num_tokens <= budget if sched.running else out.num_tokens == 0
        assert out.num_tokens == sum(c.num_tokens for c in out.chunks)
        assert len(sched.running) <= sc.max_num_seqs
        assert len(chunk_ids) == len(chunk_reqs), "a request is scheduled twice in one step"
        assert len(preempted_ids) == len(out.preempted), "a request is preempted twice"
        assert not chunk_ids & preempted_ids, "a preempted request is still scheduled"
        assert {id(r) for r in sched.running} >= chunk_ids, "a scheduled request is not running"

        # Each chunk continues where the cache ends, within the request, with pages for it.
        running_ids = {id(r) for r in running_before}
        for c in out.chunks:
            r = c.request
            assert c.num_tokens >= 1
            assert c.start == r.num_computed_tokens
            if id(r) in running_ids:
                assert c.start == computed_before[id(r)]
            else:  # admitted: starts after its cached pages, never past its last token
                assert computed_before[id(r)] == 0 and c.start % ps == 0 and c.start < c.end
                assert c.start == 0 or sc.prefix_caching
            assert c.end <= r.num_tokens <= sc.max_model_len + 1
            assert c.end <= sc.max_model_len
            assert len(r.page_ids) == math.ceil(c.end / ps), (
                f"request {r.request_id}: {len(r.page_ids)} pages for {c.end} tokens"
            )
            if sc.threshold and not r.is_decoding:
                assert c.num_tokens <= sc.threshold
            if not c.samples:  # a prompt is cut only when the budget or the threshold says so
                assert out.num_tokens == budget or c.num_tokens == sc.threshold
        for r in sched.running:
            if id(r) not in chunk_ids:
                assert len(r.page_ids) == math.ceil(r.num_computed_tokens / ps)
                assert not r.is_decoding, "a decoding request was skipped"
                assert out.num_tokens == budget, "a running prefill idles with budget left"
        self.pool.check_invariant(sched.owners())

        # Decodes first: every request that was decoding got its token unless preempted.
        for r in decoding_before:
            if id(r) not in preempted_ids:
                chunk = next((c for c in out.chunks if c.request is r), None)
                assert chunk is not None and chunk.num_tokens == 1 and chunk.samples, (
                    f"decoding request {r.request_id} skipped"
                )
        kinds = [not c.request.is_decoding for c in out.chunks]
        assert kinds == sorted(kinds), "chunks do not list decodes before prefills"

        # Preemption: victims are the most recently admitted, newest first; they go back to
        # the head of the queue in admission order, and nothing is admitted in that step.
        for v in out.preempted:
            assert v.status is RequestStatus.WAITING
            assert v.page_ids == [] and v.num_computed_tokens == 0
            assert all(self.admit_seq[id(v)] > self.admit_seq[id(r)] for r in sched.running)
        seqs = [self.admit_seq[id(v)] for v in out.preempted]
        assert seqs == sorted(seqs, reverse=True)
        self.total_preemptions += len(out.preempted)
        for v in out.preempted:
            self.expected_waiting.appendleft(v)

        # Admission: FCFS, a prefix of the (model) waiting queue; never in a preempting step.
        admitted = [r for r in sched.running if id(r) not in {id(x) for x in running_before}]
        if out.preempted:
            assert admitted == []
        assert admitted == list(self.expected_waiting)[: len(admitted)], "admission is not FCFS"
        for r in admitted:
            self.expected_waiting.popleft()
            self.hit_tokens += r.num_computed_tokens
            self.num_admissions += 1
            self.admit_seq[id(r)] = self.num_admissions
            assert id(r) in chunk_ids, "an admitted request got no tokens"
        assert list(sched.waiting) == list(self.expected_waiting)

        # Admission stops only for a reason: budget, max_num_seqs or pages for the head
        # (beyond the watermark, unless nothing runs).
        if sched.waiting and not out.preempted:
            head = sched.waiting[0]
            left = budget - out.num_tokens
            hit_pages = self.cached_prefix_pages(head)
            hit = len(hit_pages)
            n = min(head.num_tokens - hit * ps, max(left, 1), sc.threshold or budget)
            # cached pages nobody holds are counted free until the head would take them
            need = math.ceil((hit * ps + n) / ps) - hit
            need += sum(self.pool.is_evictable(p) for p in hit_pages)
            reserve = sc.watermark_pages if sched.running else 0
            assert (
                left == 0
                or len(sched.running) == sc.max_num_seqs
                or not self.pool.can_allocate(need + reserve)
            ), "admission stopped for no reason"

    def check_between_steps(self) -> None:
        sched, ps = self.sched, self.sc.page_size
        self.pool.check_invariant(sched.owners())
        assert len(sched.running) <= self.sc.max_num_seqs
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.page_ids) == math.ceil(r.num_computed_tokens / ps)
            assert r.num_uncomputed_tokens >= 1
        for r in sched.waiting:
            assert r.status is RequestStatus.WAITING and r.page_ids == []
            assert r.num_computed_tokens == 0
        holders = {p for r in sched.running for p in r.page_ids}
        assert self.pool.num_used == len(holders)
        if not self.sc.prefix_caching:
            assert self.pool.num_cached == 0

    def check_final(self) -> None:
        sched, sc = self.sched, self.sc
        assert not sched.running and not sched.waiting and sched.num_unfinished == 0
        assert self.pool.num_free == sc.num_pages and self.pool.num_used == 0
        assert sched.num_preemptions == self.total_preemptions
        assert sched.prefix_hits == self.hit_tokens
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
                last = want[-1]
                assert req.finish_reason == ("stop" if last == EOS else "length")


# ---- the property -----------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_properties(sc: Scenario) -> None:
    Harness(sc).run()


# ---- targeted scenarios -----------------------------------------------------------------


def _scenario(
    *,
    page_size: int,
    max_model_len: int,
    num_pages: int,
    max_num_seqs: int,
    budget: int,
    requests: list[tuple[int, int, int]],
) -> Scenario:
    sc = Scenario(page_size, max_model_len, num_pages, max_num_seqs, budget, eos_every=0)
    for rid, (arrival, prompt_len, max_tokens) in enumerate(requests):
        room = max(1, max_model_len - prompt_len)
        sc.specs.append(Spec(rid, arrival, prompt_len, min(max_tokens, room), None))
    return sc


def test_preemption_recomputes_same_tokens() -> None:
    """A pool of one max-length sequence forces preemptions; outputs match a huge pool."""
    reqs = [(0, 5, 20), (0, 7, 20), (1, 3, 20), (2, 9, 20), (2, 2, 20)]
    small = Harness(
        _scenario(
            page_size=2, max_model_len=32, num_pages=16, max_num_seqs=4, budget=8, requests=reqs
        )
    )
    small.run()
    big = Harness(
        _scenario(
            page_size=2, max_model_len=32, num_pages=400, max_num_seqs=4, budget=8, requests=reqs
        )
    )
    big.run()
    assert small.total_preemptions > 0 and big.total_preemptions == 0
    for rid in range(len(reqs)):
        assert small.requests[rid].output_token_ids == big.requests[rid].output_token_ids
        assert small.requests[rid].finish_reason == big.requests[rid].finish_reason == "length"


def test_chunked_prefill_never_blocks_decodes() -> None:
    """A long prompt is split into chunks while the running request decodes every step."""
    h = Harness(
        _scenario(
            page_size=4,
            max_model_len=64,
            num_pages=64,
            max_num_seqs=2,
            budget=5,
            requests=[(0, 2, 30), (2, 40, 2)],
        )
    )
    sched = h.sched
    sched.add(h.requests[0])
    h.expected_waiting.append(h.requests[0])
    h.step()  # request 0: whole prompt
    h.step()  # request 0: decode
    sched.add(h.requests[1])
    h.expected_waiting.append(h.requests[1])
    sizes = []
    while h.requests[1].num_computed_tokens < 40:
        out = sched.schedule()
        assert [c.request.request_id for c in out.chunks] == ["0", "1"]
        assert out.chunks[0].num_tokens == 1 and out.chunks[0].samples
        sizes.append(out.chunks[1].num_tokens)
        sched.update_after_step(out)
        for c in out.chunks:
            if c.samples:
                c.request.append_token(7)
    assert sizes == [4] * 10


def test_waiting_request_abort_and_double_finish() -> None:
    pool = PagePool(8)
    sched = Scheduler(page_pool=pool, page_size=4, max_num_seqs=2, max_num_batched_tokens=4)
    a, b = (make_request(Spec(i, 0, 3, 4, None)) for i in range(2))
    sched.add(a)
    sched.add(b)
    sched.finish(b)  # still waiting
    assert list(sched.waiting) == [a] and b.finished
    out = sched.schedule()
    assert [c.request for c in out.chunks] == [a] and pool.num_used == 1
    sched.finish(a)
    sched.finish(a)  # finishing twice is harmless
    assert pool.num_free == 8 and sched.num_unfinished == 0


def test_budget_must_cover_one_decode_per_sequence() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(page_pool=PagePool(4), page_size=4, max_num_seqs=8, max_num_batched_tokens=4)
