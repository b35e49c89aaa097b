"""What the engine learns from each step it ran, apart from running it.

`LLMEngine.step` (and its async form) schedule, run and apply results; after a step they
hand `StepObserver.ran` the schedule, the bucket and the step's times, and the observer
keeps the counters `stats()` reports, the bucket histogram, the step records
(`record_steps`), the ITL controller's feed and the swap cost model's step-time samples.
The last two exist only for synchronous engines (inflight.sync_reason): with either, an
engine never overlaps steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from jaxcb.engine.interface import StepRecord
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.schedule import SchedulerOutput


@dataclass(frozen=True)
class StepTimes:
    """A step's perf_counter() times and seconds."""

    started: float  # when the step began (before scheduling)
    ended: float  # when its outputs were ready
    host: float  # host work in it
    device: float  # waiting for the device, swap copies included
    swap: float = 0.0  # of `device`, the swap copies'


class StepObserver:
    def __init__(self, pool: PagePool, *, itl: Any = None, swap_cost: Any = None) -> None:
        """`itl`: the ITL controller (engine/sched/itl_controller.py) to feed, if any;
        `swap_cost`: the swap-or-recompute cost model (engine/sched/swap.py) to feed, if any."""
        self.pool = pool
        self.itl = itl
        self.swap_cost = swap_cost
        self.counts: Counter[str] = Counter()
        self.bucket_hist: Counter[int] = Counter()
        self.records: list[StepRecord] | None = None  # record_steps() turns it on
        self._last_step_end: float | None = None  # after the last step, while requests run

    def ran(
        self,
        sched: SchedulerOutput,
        bucket_tokens: int,
        token_budget: int,
        times: StepTimes,
        *,
        had_decode: bool = False,
        still_running: bool = True,
    ) -> None:
        """A step ran `sched` in a bucket of `bucket_tokens` under `token_budget`.
        `had_decode`: it computed decode tokens (asked before its results were applied);
        `still_running`: requests run on after it (else the next step's ITL starts anew)."""
        c = self.counts
        c["steps"] += 1
        c["tokens_scheduled"] += sched.num_tokens
        c["token_slots"] += bucket_tokens
        c["preemptions"] += len(sched.preempted)
        c["recomputed_tokens"] += sched.num_recomputed_tokens
        c["prefix_queries"] += sched.num_prefix_query_tokens
        c["prefix_hits"] += sched.num_prefix_hit_tokens
        self.idle(host=times.host, device=times.device)
        self.bucket_hist[bucket_tokens] += 1
        if self.records is not None:
            self.records.append(
                StepRecord.of(sched, bucket_tokens, self.pool.num_used, token_budget)
            )
        if self.swap_cost is not None:
            self.swap_cost.observe_step(sched.num_tokens, times.device - times.swap)
        if self.itl is not None:
            # The ITL a decoding request sees: from the previous step's end (the caller's
            # work between steps included) to this one's; nothing ran before: this step.
            start = times.started if self._last_step_end is None else self._last_step_end
            self.itl.feed(times.ended - start, had_decode, bucket_tokens)
            self._last_step_end = times.ended if still_running else None

    def idle(self, *, host: float, device: float) -> None:
        """Seconds spent outside a step that ran (an empty schedule, a drain)."""
        self.counts["host_seconds"] += host
        self.counts["device_seconds"] += device
