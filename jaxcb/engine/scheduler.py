"""Iteration-level scheduler: decode tokens first, then chunked prefill, under a token budget.

Each call to `schedule()` decides one step:
1. every running request that is decoding gets its one token;
2. running requests still in prefill get chunks of what is left of the budget;
3. waiting requests are admitted first-come-first-served while the budget, `max_num_seqs`
   and free pages allow (the head of the queue is never skipped).
If a running request needs a page and none is free, the most recently admitted running request
is preempted: its pages are freed and it goes back to the head of the waiting queue, to be
recomputed later. No request is admitted in a step that preempted.

Pure Python: no jax, no device. The engine calls `schedule()`, runs the step, then
`update_after_step()` and `finish()`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxcb.engine.page_pool import PagePool
from jaxcb.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first token fed this step (= num_computed_tokens before)
    num_tokens: int  # tokens fed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the newest token, so the step samples the next one."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.num_tokens == 1 and c.samples)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        *,
        page_pool: PagePool,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                f"({max_num_seqs}) so every running request can decode each step"
            )
        self.pool = page_pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's pages; it leaves every queue."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def owners(self) -> Iterable[list[int]]:
        """Page lists of every request holding pages (for the pool invariant)."""
        return [r.page_ids for r in self.running]

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[int, ScheduledChunk] = {}  # id(request) -> chunk
        budget = self.max_num_batched_tokens

        for decode_pass in (True, False):
            for request in list(self.running):
                if request.status is not RequestStatus.RUNNING or id(request) in scheduled:
                    continue  # preempted earlier in this step, or already given its tokens
                if request.is_decoding != decode_pass or budget == 0:
                    continue
                n = min(request.num_uncomputed_tokens, budget)
                num_preempted = len(out.preempted)
                reserved = self._reserve_pages(request, n, scheduled, out)
                if len(out.preempted) != num_preempted:  # victims give their tokens back
                    budget = self.max_num_batched_tokens - sum(
                        c.num_tokens for c in scheduled.values()
                    )
                if not reserved:
                    continue  # the request itself was preempted
                scheduled[id(request)] = ScheduledChunk(request, request.num_computed_tokens, n)
                budget -= n

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                n = min(request.num_uncomputed_tokens, budget)
                if not self.pool.can_allocate(self._pages_short(request, n)):
                    break
                self.waiting.popleft()
                self._admit(request)
                self._allocate(request, n)
                scheduled[id(request)] = ScheduledChunk(request, request.num_computed_tokens, n)
                budget -= n

        out.chunks = sorted(scheduled.values(), key=lambda c: not c.request.is_decoding)
        return out

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: the fed tokens' K/V are now in the cache."""
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.end

    # ---- internals ----------------------------------------------------------------------

    def _pages_short(self, request: Request, num_new_tokens: int) -> int:
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.page_size)
        return max(0, needed - len(request.page_ids))

    def _allocate(self, request: Request, num_new_tokens: int) -> None:
        request.page_ids.extend(self.pool.allocate(self._pages_short(request, num_new_tokens)))

    def _reserve_pages(
        self,
        request: Request,
        n: int,
        scheduled: dict[int, ScheduledChunk],
        out: SchedulerOutput,
    ) -> bool:
        """Allocate pages for n more tokens, preempting the newest requests if needed."""
        while not self.pool.can_allocate(self._pages_short(request, n)):
            victim = self.running[-1]
            self._preempt(victim)
            scheduled.pop(id(victim), None)
            out.preempted.append(victim)
            if victim is request:
                return False
        self._allocate(request, n)
        return True

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _release(self, request: Request) -> None:
        self.pool.free(request.page_ids)
        request.page_ids = []

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
