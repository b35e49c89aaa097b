"""Iteration-level scheduler: decode tokens first, then chunked prefill, under a token budget.

Each call to `schedule()` decides one step:
1. every running request that is decoding gets its one token;
2. running requests still in prefill get chunks of what is left of the budget (at most
   `long_prefill_token_threshold` tokens each, if set, so one huge prompt cannot take it all);
3. waiting requests are admitted from the head of the queue while the budget, `max_num_seqs`
   and free pages allow (the head is never skipped; the policy orders the queue). Admission
   leaves `watermark_pages` free for the running requests' growth (unless none runs).
If a running request needs a page and none is free, the policy picks a running request to
preempt: its pages are released and it goes back to the waiting queue, to be recomputed
later, or, preempted by swap (`preemption_mode`, engine/sched/swap.py), to be resumed with its
K/V copied back from host memory. No request is admitted in a step that preempted.

Admission modes (`admission`) decide how many free pages the head of the queue needs:
  greedy     pages for its first chunk, beyond the watermark: the pool fills up at once, and
             running requests that outgrow it preempt one another;
  reserve    pages for every position it can fill (prompt + max_tokens), beyond the pages
             already promised to running requests: a request admitted so never preempts, at
             the price of pages held idle for outputs that may stop early;
  predicted  as reserve, for the prompt + min(max_tokens, a high quantile of the output
             lengths observed so far; OutputLengths in policies.py), and the watermark; a
             request outgrowing its prediction takes free pages as greedy does (and may
             preempt).
A running request's growth comes out of its own promise first: free pages minus the pages
promised to running requests (`admitted_idle_pages`) are what admission may hand out. When
nothing runs, the head is admitted if its first chunk fits, whatever the mode, so a request
whose promise the pool cannot hold still runs alone.

Prefix caching (`enable_prefix_caching`): a request being admitted shares every cached full
page of its tokens, up to the first miss (see page_pool.py), and starts computing after them.
It never matches its whole sequence, so at least its last token is computed (the step needs
its logits) and nothing is ever written into a shared page. A request that wants prompt
logprobs matches no page past the first prompt position it still has to score (vLLM skips
the cache for them too), but registers its pages for others. After each step, every page
that became full is registered in the cache; released pages stay cached until evicted, so a
preempted request's recompute finds its own pages again.

Pure Python: no jax, no device. The engine calls `schedule()`, runs the step, then
`update_after_step()` and `finish()`.
"""

from __future__ import annotations

from typing import Any

from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.base import BaseScheduler
from jaxcb.engine.sched.page_pool import hash_page
from jaxcb.engine.sched.policies import ADMISSION_MODES, OutputLengths, reserved_tokens
from jaxcb.engine.sched.schedule import ScheduledChunk, SchedulerOutput
from jaxcb.engine.sched.swap import Swapper


class Scheduler(BaseScheduler):
    """The continuous (iteration-level) scheduler; see the module docstring."""

    def __init__(
        self,
        *,
        enable_prefix_caching: bool = False,
        long_prefill_token_threshold: int = 0,
        watermark_pages: int = 0,
        admission: str = "greedy",
        admission_quantile: float = 0.9,
        swapper: Swapper | None = None,  # None: preemption by recompute only
        # sampling rows of the largest step; those past max_num_seqs take proposed tokens
        # (speculative decoding). None: max_num_seqs
        max_num_sample_rows: int | None = None,
        **base: Any,  # BaseScheduler's: page_pool, page_size, max_num_seqs, ...
    ) -> None:
        super().__init__(**base)
        page_pool = self.pool
        self.swapper = swapper
        if admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {list(ADMISSION_MODES)}, got {admission!r}")
        self.admission = admission
        # Observed in every mode (stats report it); only `predicted` admits by it.
        self.output_lengths = OutputLengths(admission_quantile)
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: no cap), "
                f"got {long_prefill_token_threshold}"
            )
        if not 0 <= watermark_pages < page_pool.num_pages:
            raise ValueError(
                f"watermark_pages must be in [0, {page_pool.num_pages}), got {watermark_pages}"
            )
        self.enable_prefix_caching = enable_prefix_caching
        self.long_prefill_token_threshold = (
            long_prefill_token_threshold or self.max_num_batched_tokens
        )
        self.watermark_pages = watermark_pages
        self.max_num_sample_rows = max_num_sample_rows or self.max_num_seqs
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admissions
        self.prefix_hits = 0  # of which found cached

    # ---- one step -----------------------------------------------------------------------

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """Decide one step under `token_budget` tokens (default max_num_batched_tokens; the
        ITL controller passes a smaller bucket size, at least the running decodes')."""
        if token_budget is None:
            token_budget = self.max_num_batched_tokens
        elif not 1 <= token_budget <= self.max_num_batched_tokens:
            raise ValueError(
                f"token_budget must be in [1, {self.max_num_batched_tokens}], got {token_budget}"
            )
        out = SchedulerOutput()
        scheduled: dict[int, ScheduledChunk] = {}  # id(request) -> chunk
        budget = token_budget
        self.num_steps += 1
        self.policy.reorder(self.waiting)

        # Speculative decoding: proposed tokens take the sampling rows past those of
        # max_num_seqs requests, and budget that leaves every decode its token.
        spare_rows = self.max_num_sample_rows - self.max_num_seqs
        decodes_left = sum(r.is_decoding for r in self.running)
        for decode_pass in (True, False):
            for request in list(self.running):
                if request.status is not RequestStatus.RUNNING or id(request) in scheduled:
                    continue  # preempted earlier in this step, or already given its tokens
                if request.is_decoding != decode_pass or budget == 0:
                    continue
                if request.reached_max_tokens:
                    continue  # its token in flight is its last (async scheduling)
                n = min(request.num_uncomputed_tokens, budget, self.long_prefill_token_threshold)
                drafts: tuple[int, ...] = ()
                if decode_pass:
                    decodes_left -= 1
                    room = min(spare_rows, budget - 1 - decodes_left)
                    drafts = self._drafts_that_fit(request, room)
                    spare_rows -= len(drafts)
                    n += len(drafts)
                num_preempted = len(out.preempted)
                reserved = self._reserve_pages(request, n, scheduled, out)
                if len(out.preempted) != num_preempted:  # victims give their tokens back
                    budget = token_budget - sum(c.num_tokens for c in scheduled.values())
                if not reserved:
                    continue  # the request itself was preempted
                scheduled[id(request)] = ScheduledChunk(
                    request, request.num_computed_tokens, n, draft_token_ids=drafts
                )
                budget -= n

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hit_pages = self._match_prefix(request)
                # (a request swapped out resumes after its computed tokens)
                num_hit = max(len(hit_pages) * self.page_size, request.num_computed_tokens)
                n = min(request.num_tokens - num_hit, budget, self.long_prefill_token_threshold)
                # Cached pages nobody holds count as free until this request takes them.
                needed = -(-(num_hit + n) // self.page_size) - len(hit_pages)
                needed += sum(self.pool.is_evictable(p) for p in hit_pages)
                if not self._admissible(request, hit_pages, needed):
                    break
                if not self._take_lora_slot(request, out):
                    break  # (every slot is pinned by other adapters' running requests)
                self.waiting.popleft()
                self._admit(request, hit_pages, out)
                self._allocate(request, n)
                scheduled[id(request)] = ScheduledChunk(request, request.num_computed_tokens, n)
                budget -= n

        out.chunks = sorted(scheduled.values(), key=lambda c: not c.request.is_decoding)
        out.admitted_idle_pages = self.admitted_idle_pages
        out.predicted_output_len = self.predicted_output_len
        return out

    def finish(self, request: Request) -> None:
        """As BaseScheduler's; a request that stopped or hit its length limit (not an abort
        or an error) adds its output length to the observations `predicted` admits by."""
        if not request.finished and request.finish_reason in ("stop", "length"):
            self.output_lengths.observe(len(request.output_token_ids))
        if request.swap_slots is not None:  # aborted while swapped out: free its host slots
            self.swapper.space.free(request.swap_slots)
            request.swap_slots = None
        super().finish(request)

    @property
    def admitted_idle_pages(self) -> int:
        if self.admission == "greedy":
            return 0
        ps = self.page_size
        return sum(max(0, -(-r.num_reserved_tokens // ps) - len(r.page_ids)) for r in self.running)

    @property
    def predicted_output_len(self) -> int | None:
        return self.output_lengths.prediction

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: the fed tokens' K/V are now in the cache; pages that became full
        join the prefix cache."""
        for chunk in output.chunks:
            request = chunk.request
            if request.finished:
                # (async scheduling: it stopped on the token the step before this one
                # sampled; what this step computed for it is dropped, its pages are free)
                continue
            # (proposed tokens count once kept: OutputProcessor)
            request.num_computed_tokens = chunk.end - chunk.num_draft_tokens
            if self.enable_prefix_caching:
                self._register_full_pages(request)

    # ---- prefix caching -----------------------------------------------------------------

    def _page_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """The chained hashes of the request's first `num_pages` full pages."""
        hashes, ps = request.page_hashes, self.page_size
        while len(hashes) < num_pages:
            i = len(hashes)
            # (the first page chains from the request's adapter: none shares another's pages)
            parent = hashes[-1] if i else request.lora_key
            hashes.append(hash_page(parent, request.token_ids[i * ps : (i + 1) * ps]))
        return hashes

    def _match_prefix(self, request: Request) -> list[int]:
        """Cached pages holding the request's leading full pages, up to the first miss.
        At most (num_tokens - 1) // page_size of them: the last token is always computed;
        and none past the first position that still has a prompt logprob to score (its row
        must be computed; the request still registers its pages for others)."""
        if not self.enable_prefix_caching:
            return []
        num_pages = (request.num_tokens - 1) // self.page_size
        first_scored = request.next_prompt_logprob_position
        if first_scored is not None:
            num_pages = min(num_pages, first_scored // self.page_size)
        pages = []
        for h in self._page_hashes(request, num_pages):
            page = self.pool.lookup(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def _register_full_pages(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.page_size
        if num_full <= request.num_hashed_pages:
            return
        hashes = self._page_hashes(request, num_full)
        for i in range(request.num_hashed_pages, num_full):
            # False: another request cached the same prefix first; this page stays private.
            self.pool.register(request.page_ids[i], hashes[i])
        request.num_hashed_pages = num_full

    # ---- internals ----------------------------------------------------------------------

    def _drafts_that_fit(self, request: Request, room: int) -> tuple[int, ...]:
        """The request's proposed tokens that `room` sampling rows and budget and the free
        pages hold (never a preemption for a proposal)."""
        drafts = request.draft_token_ids[: max(0, min(room, self.long_prefill_token_threshold - 1))]
        while drafts and not self.pool.can_allocate(self._pages_short(request, 1 + len(drafts))):
            drafts = drafts[:-1]
        return tuple(drafts)

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
        """Allocate pages for n more tokens, preempting the policy's victims if needed."""
        while not self.pool.can_allocate(self._pages_short(request, n)):
            victim = self.policy.victim(self.running)
            out.num_recomputed_tokens += self._preempt(victim, out)
            scheduled.pop(id(victim), None)
            out.preempted.append(victim)
            if victim is request:
                return False
        self._allocate(request, n)
        return True

    def _admissible(self, request: Request, hit_pages: list[int], needed: int) -> bool:
        """Whether the head of the queue may be admitted (see the module docstring);
        `needed`: the free pages its first chunk takes (evictable cached pages included)."""
        if not self.running:
            return self.pool.num_free >= needed
        if self.admission == "greedy":
            return self.pool.num_free >= needed + self.watermark_pages
        promise = reserved_tokens(self.admission, request, self.predicted_output_len)
        # The free pages its whole promise takes: new ones, and the evictable ones it shares.
        evictable = sum(self.pool.is_evictable(p) for p in hit_pages)
        whole = -(-promise // self.page_size) - len(hit_pages) + evictable
        watermark = self.watermark_pages if self.admission == "predicted" else 0
        return self.pool.num_free - self.admitted_idle_pages >= whole + watermark

    def _admit(self, request: Request, hit_pages: list[int], out: SchedulerOutput) -> None:
        num_swapped_tokens = request.num_computed_tokens  # > 0 only if swapped out
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.num_reserved_tokens = reserved_tokens(
            self.admission, request, self.predicted_output_len
        )
        if self.enable_prefix_caching:
            self.pool.acquire(hit_pages)
            request.page_ids = list(hit_pages)
            request.num_hashed_pages = len(hit_pages)
            request.num_computed_tokens = len(hit_pages) * self.page_size
            out.num_prefix_query_tokens += request.num_tokens
            out.num_prefix_hit_tokens += request.num_computed_tokens
            self.prefix_queries += request.num_tokens
            self.prefix_hits += request.num_computed_tokens
        if request.swap_slots is not None:
            self._swap_in(request, num_swapped_tokens, out)
        elif request.num_dropped_tokens and self.swapper is not None:
            self.swapper.observe_resume(request.num_dropped_tokens, request.num_computed_tokens)
        request.num_dropped_tokens = 0
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens

    def _release(self, request: Request) -> None:
        super()._release(request)
        request.num_hashed_pages = 0
        request.num_reserved_tokens = 0

    def _swap_in(self, request: Request, num_swapped_tokens: int, out: SchedulerOutput) -> None:
        """Resume a swapped-out request. The prefix cache's pages (taken in `_admit`) hold
        its head; fresh pages receive the host copies of the rest. If the cache holds as
        much as the host does, nothing is copied."""
        slots, request.swap_slots = request.swap_slots, None
        first = len(request.page_ids)
        self.swapper.observe_resume(num_swapped_tokens, first * self.page_size)
        if num_swapped_tokens > first * self.page_size:
            pages = self.pool.allocate(len(slots) - first)
            out.swap_in.extend(zip(slots[first:], pages, strict=True))
            request.page_ids.extend(pages)
            request.num_computed_tokens = num_swapped_tokens
        self.swapper.space.free(slots)
        self.swapper.num_swapped_in += 1
        out.num_swapped_in += 1

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        """Host slots for a victim's computed pages and their copies, if the swapper says
        swap and the host pool has room (else False: recompute it)."""
        if self.swapper is None:
            return False
        num_pages = -(-request.num_computed_tokens // self.page_size)
        fallbacks = self.swapper.num_fallbacks
        slots = self.swapper.slots_for(request.num_computed_tokens, num_pages)
        out.num_swap_fallbacks += self.swapper.num_fallbacks - fallbacks
        if slots is None:
            return False
        # (page_ids may hold more pages, allocated for this step's chunk: nothing in them yet)
        out.swap_out.extend(zip(request.page_ids[: len(slots)], slots, strict=True))
        request.swap_slots = slots
        out.num_swapped_out += 1
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Back to the queue, its pages released (swapped out first if the swapper says
        so); returns the computed tokens it drops (0 if swapped out; what the prefix cache
        gives back at its recompute is not subtracted)."""
        self.running.remove(request)
        swapped = self._swap_out(request, out)
        dropped = 0 if swapped else request.num_computed_tokens
        self._release(request)
        if not swapped:
            request.num_computed_tokens = 0
            request.num_dropped_tokens = dropped
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.enqueue(self.waiting, request, preempted=True)
        return dropped
