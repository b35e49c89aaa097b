"""Batching baselines: static and dynamic batching of padded batches, on jaxcb's own engine.

They exist to be compared with the real scheduler (`scheduler.batching`: continuous | static
| dynamic; `python -m jaxcb.bench compare_batching`). Both are `BaseScheduler`s (base.py),
as the continuous `Scheduler` (scheduler.py) is, so `LLMEngine` runs them unchanged;
`factory.make_scheduler` picks one from the config.

Both model a *padded batch*: a rectangle of `rows x width` token slots in which every row is one
request, and every slot a real token does not fill is padding that still costs compute. The
padding travels in `SchedulerOutput.num_padding_tokens`: the engine picks the bucket for
real + padding tokens, so the padded work really runs (on padding rows, which write nothing;
the native CPU matmuls, which skip a bucket's rounding, compute them: they are counted in
`StepInput.num_compute_tokens`), and `stats()` counts it in the padding fraction.

static    a batch of up to `max_num_seqs` requests is formed when the previous one is done.
          Its prompts are left-padded to the longest and prefilled together (in column chunks
          of `max_num_batched_tokens // rows`), then it decodes, one token per row per step,
          until its slowest request is done: a finished row keeps its slot as padding.
          Padding of one batch = sum(L_max - n_i) + sum(T_max - T_i).
dynamic   finished rows leave the batch and free slots are refilled from the queue. A new
          request's prompt is prefilled inside the padded batch, so while it takes n columns
          every running request, which decodes one token, pads the other n - 1: admitting one
          request of n prompt tokens into a batch of B rows costs (n - 1)(B - 1) padding tokens.
          The requests admitted together form one group, left-padded to its longest prompt; no
          new group is admitted until the current one has finished its prefill.

Neither ever preempts: a request is admitted only when the pool can hold its whole length
(prompt + max_tokens), as systems that reserve the maximum length do. Prefix caching,
`long_prefill_token_threshold` and the watermark do not apply to them.

Pure Python, no jax.
"""

from __future__ import annotations

from typing import Any

from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.base import BaseScheduler
from jaxcb.engine.sched.schedule import ScheduledChunk, SchedulerOutput


class _PaddedBatchScheduler(BaseScheduler):
    """What static and dynamic batching share: page reservation, the padded prefill of a
    group of requests, and padded decode steps. Subclasses decide admission and how many rows
    the batch has."""

    batching = ""

    def __init__(self, **base: Any) -> None:  # BaseScheduler's arguments
        super().__init__(**base)
        # num_preemptions stays 0: admission reserves whole sequences
        self.num_padding_tokens = 0  # batch padding so far (not the bucket's rounding)
        # The group being prefilled: its members, the padded prompt width, the columns done
        # so far, and the column each member's first token sits in (left padding).
        self._group: list[Request] = []
        self._group_width = 0
        self._column = 0
        self._first_column: dict[int, int] = {}  # id(request) -> column

    def _release(self, request: Request) -> None:
        super()._release(request)
        if request in self._group:
            self._group.remove(request)
            if not self._group:
                self._end_group()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        if not self._group:
            self._admit()
        rows = self._num_rows()
        if rows == 0:
            return out
        if self._group:
            width = min(self._group_width - self._column, self.max_num_batched_tokens // rows)
            lo, hi = self._column, self._column + width
            decodes, prefills = [], []
            for request in self.running:
                first = self._first_column.get(id(request))
                if first is None:  # not in the group: decodes one token, pads width - 1
                    decodes.append(self._chunk(request, 1))
                elif hi > max(lo, first):
                    prefills.append(self._chunk(request, hi - max(lo, first)))
            out.chunks = decodes + prefills
            self._column = hi
            if hi == self._group_width:
                self._end_group()
        else:
            width = 1
            out.chunks = [self._chunk(r, 1) for r in self.running]
        out.num_padding_tokens = rows * width - out.num_tokens
        self.num_padding_tokens += out.num_padding_tokens
        return out

    def update_after_step(self, output: SchedulerOutput) -> None:
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.end

    # ---- internals ----------------------------------------------------------------------

    def _admit(self) -> None:
        raise NotImplementedError

    def _num_rows(self) -> int:
        raise NotImplementedError

    def _chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        needed = -(-(start + num_tokens) // self.page_size) - len(request.page_ids)
        if needed > 0:  # reserved at admission, so always there
            request.page_ids.extend(self.pool.allocate(needed))
        return ScheduledChunk(request, start, num_tokens)

    def _full_pages(self, request: Request) -> int:
        """Pages the request holds when it is done: every token but the last is cached."""
        num_tokens = request.num_prompt_tokens + request.max_tokens - 1
        return -(-num_tokens // self.page_size)

    def _admit_from_queue(self, slots: int) -> list[Request]:
        """Pop requests from the head of the queue while slots and reservable pages allow."""
        reserved = sum(self._full_pages(r) - len(r.page_ids) for r in self.running)
        admitted: list[Request] = []
        while self.waiting and len(admitted) < slots:
            request = self.waiting[0]
            need = self._full_pages(request)
            if need + reserved > self.pool.num_free:
                if not self.running and not admitted:
                    raise RuntimeError(
                        f"{self.batching} batching reserves a request's whole length at "
                        f"admission: request {request.request_id} needs {need} KV pages, the "
                        f"pool has {self.pool.num_free} free"
                    )
                break
            self.waiting.popleft()
            reserved += need
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens is None:
                request.num_cached_tokens = 0
            self.running.append(request)
            admitted.append(request)
        if admitted:
            self._group = list(admitted)
            self._group_width = max(r.num_tokens for r in admitted)
            self._column = 0
            self._first_column = {id(r): self._group_width - r.num_tokens for r in admitted}
        return admitted

    def _end_group(self) -> None:
        self._group, self._group_width, self._column = [], 0, 0
        self._first_column = {}


class StaticBatchScheduler(_PaddedBatchScheduler):
    """A batch is formed only when the last one is done, and keeps its rows until then."""

    batching = "static"

    def __init__(self, **base: Any) -> None:
        super().__init__(**base)
        self._batch_rows = 0

    def _admit(self) -> None:
        if not self.running:
            self._batch_rows = len(self._admit_from_queue(self.max_num_seqs))

    def _num_rows(self) -> int:
        return self._batch_rows if self.running else 0


class DynamicBatchScheduler(_PaddedBatchScheduler):
    """Finished rows leave; free slots are refilled between prefill groups."""

    batching = "dynamic"

    def _admit(self) -> None:
        self._admit_from_queue(self.max_num_seqs - len(self.running))

    def _num_rows(self) -> int:
        return len(self.running)
