"""The scheduler interface LLMEngine drives (BaseScheduler), and what every scheduler shares:
the waiting queue in the policy's order, the running list, arrival stamps, and the pages of
finished and aborted requests given back. The continuous scheduler (scheduler.py) and the
padded-batch baselines (baselines.py) build on it.

Pure Python: no jax, no device.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterable

from jaxcb.engine.lora_slots import LoraSlots
from jaxcb.engine.request import Request, RequestStatus
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.policies import SchedulingPolicy, make_policy
from jaxcb.engine.sched.schedule import SchedulerOutput


class BaseScheduler(abc.ABC):
    """What LLMEngine drives, whatever the batching: requests join with `add`, each step is
    `schedule()` then (after the device ran it) `update_after_step()`, and `finish()` takes a
    finished or aborted request out, freeing its pages. The continuous scheduler (scheduler.py)
    and the padded-batch baselines (baselines.py) implement `schedule` and `update_after_step`;
    the queues and the page bookkeeping are shared here."""

    def __init__(
        self,
        *,
        page_pool: PagePool,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str | SchedulingPolicy = "fcfs",
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
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.waiting: deque[Request] = deque()  # in the policy's order: the head goes next
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock of arrival_step and srpf aging
        self._num_arrivals = 0
        # LoRA (engine/lora_slots.py): the device's adapter slots; None when LoRA is off.
        self.lora_slots: LoraSlots | None = None

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide one step."""

    @abc.abstractmethod
    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: the fed tokens' K/V are now in the cache."""

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.arrival_seq < 0:
            request.arrival_seq = self._num_arrivals
            request.arrival_step = self.num_steps
            self._num_arrivals += 1
        self.policy.enqueue(self.waiting, request, preempted=False)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def admitted_idle_pages(self) -> int:
        """Pages promised to running requests for tokens they have not reached yet."""
        return 0

    @property
    def predicted_output_len(self) -> int | None:
        """The output length `predicted` admission reserves for (None: no prediction)."""
        return None

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's pages; it leaves every queue."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def release_unneeded_pages(self, request: Request) -> None:
        """Free the pages past the request's tokens (those allocated for proposals that were
        not kept): what is written there is never read."""
        keep = -(-request.num_tokens // self.page_size)
        if len(request.page_ids) > keep:
            self.pool.free(reversed(request.page_ids[keep:]))
            del request.page_ids[keep:]

    def owners(self) -> Iterable[list[int]]:
        """Page lists of every request holding pages (for the pool invariant)."""
        return [r.page_ids for r in self.running]

    def reset_prefix_cache(self) -> int:
        """Drop every cached page nobody holds (benchmarks use it between passes)."""
        return self.pool.reset_prefix_cache()

    def _release(self, request: Request) -> None:
        # Tail first: cached pages released later are evicted later, and a sequence's head
        # pages are the ones other requests are likeliest to share.
        self.pool.free(reversed(request.page_ids))
        request.page_ids = []
        if request.lora_slot:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = 0

    def _take_lora_slot(self, request: Request, out: SchedulerOutput) -> bool:
        """Pin the slot of the request's adapter as it is admitted (a slot to write first
        goes in out.lora_loads); False when none is free: it waits. True for the base model."""
        if not request.lora_id:
            return True
        taken = self.lora_slots.acquire(request.lora_id)
        if taken is None:
            return False
        request.lora_slot, load = taken
        if load:
            out.lora_loads.append((request.lora_slot, request.lora_id))
        return True
