"""Scheduling policies: the order of the waiting queue and the choice of preemption victims.

A policy answers two questions for the `Scheduler`, and nothing else:
  enqueue(waiting, request, preempted)   where a (new or preempted) request joins the queue;
                                         the scheduler always admits from the head and never
                                         skips it, so the order is the admission order
  victim(running)                        which running request gives its pages back when a
                                         running request needs a page and none is free

fcfs      arrival order; a preempted request goes back to the head; the newest admitted
          request is preempted first (it has done the least work).
priority  lower `priority` values first, ties by arrival; the victim is the lowest-priority
          running request (the highest value), the newest admitted among equals.
srpf      shortest remaining prefill first, with aging: a request's key is its tokens to
          compute plus `aging * (the scheduler step it arrived at)`. That equals sorting by
          `remaining - aging * steps waited`, so the key never needs updating: a request that
          has waited W steps is ahead of any later arrival shorter by less than `aging * W`
          tokens. Only the finitely many requests that arrive within `remaining / aging` steps
          after it can ever overtake it, so none starves. Victims as in fcfs.
edf       earliest deadline first, for latency targets: see EDFPolicy.

Policies whose keys change as time passes (edf) re-sort the queue in `reorder`, which the
scheduler calls at the start of every step; for the others it does nothing.

Admission (how many pages a request must find free before it is admitted) is the scheduler's,
in three modes (`ADMISSION_MODES`); `reserved_tokens` and `OutputLengths` below are the parts
the modes differ in.

Pure Python, no jax.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from jaxcb.config import ADMISSION_MODES
from jaxcb.engine.request import Request

#: name -> policy class; a subclass with a `name` registers itself here (see make_policy)
POLICIES: dict[str, type[SchedulingPolicy]] = {}


@dataclass(frozen=True)
class PolicyOptions:
    """The knobs a policy may read when it is made (SchedulerConfig's, plus edf's clock)."""

    srpf_aging: float = 16.0
    edf_late_penalty_ms: float = 5000.0
    clock: Callable[[], float] = time.monotonic  # wall seconds; injectable for tests


class SchedulingPolicy:
    """A new policy is a subclass here with a `name`: defining it registers it, and the
    config's `scheduling_policy` can name it. One that reads a knob overrides `create`."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            POLICIES[cls.name] = cls

    @classmethod
    def create(cls, options: PolicyOptions) -> SchedulingPolicy:
        return cls()

    def enqueue(self, waiting: deque[Request], request: Request, *, preempted: bool) -> None:
        raise NotImplementedError

    def victim(self, running: list[Request]) -> Request:
        """`running` is in admission order."""
        return running[-1]

    def reorder(self, waiting: deque[Request]) -> None:
        """Restore the queue's order where keys change as time passes (edf); the other
        policies' keys are fixed when a request is enqueued, so this does nothing."""


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def enqueue(self, waiting: deque[Request], request: Request, *, preempted: bool) -> None:
        if preempted:  # victims are preempted newest first, so they end up in admission order
            waiting.appendleft(request)
        else:
            waiting.append(request)


class _KeyedPolicy(SchedulingPolicy):
    """The waiting queue is kept sorted by `key` (smallest first)."""

    def key(self, request: Request) -> tuple:
        raise NotImplementedError

    def enqueue(self, waiting: deque[Request], request: Request, *, preempted: bool) -> None:
        key = self.key(request)
        waiting.insert(bisect.bisect_right(waiting, key, key=self.key), request)


class PriorityPolicy(_KeyedPolicy):
    name = "priority"

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_seq)

    def victim(self, running: list[Request]) -> Request:
        # Highest value = lowest priority; among equals the newest admitted (last in the list).
        return running[max(range(len(running)), key=lambda i: (running[i].priority, i))]


class SRPFPolicy(_KeyedPolicy):
    name = "srpf"

    def __init__(self, aging: float) -> None:
        if not aging > 0:
            raise ValueError(f"srpf aging must be > 0 (or requests may starve), got {aging}")
        self.aging = aging

    @classmethod
    def create(cls, options: PolicyOptions) -> SRPFPolicy:
        return cls(options.srpf_aging)

    def key(self, request: Request) -> tuple:
        remaining = request.num_tokens - request.num_computed_tokens
        return (remaining + self.aging * request.arrival_step, request.arrival_seq)


class EDFPolicy(_KeyedPolicy):
    """Earliest deadline first, for requests with latency targets.

    A request's deadline is `arrival_time + ttft_target_ms / 1000` (seconds of `clock`,
    time.monotonic as Request.arrival_time). A request with no TTFT target has none (an
    infinite deadline): those come after every request with a deadline, fcfs among
    themselves, and under a sustained stream of requests with targets they can wait
    indefinitely (give every request a target, with the config's defaults, where that
    matters).

    Queue key at time `now`: the deadline while it can still be met (now <= deadline), and
    deadline + `late_penalty` seconds once it has passed; ties by arrival. A request that
    missed its deadline is not dropped: it falls behind the requests that can still make
    theirs, but only behind those whose deadline is earlier than its own + late_penalty.
    Keys change as time passes (a request turns late once), so `reorder` re-sorts the queue
    at the start of each step, when some queued request has turned late since the last sort.

    The bound (nothing with a deadline starves): while a request X with deadline d waits,
    no request that arrives after d + late_penalty is admitted before it. Such a request Y
    has a key >= its deadline > its arrival > d + late_penalty >= X's key (late or not),
    and the queue is sorted and its head never skipped. So whatever is admitted while X
    waits arrived before d + late_penalty: at most r * (ttft target + late_penalty) requests
    arriving after X at an arrival rate r. A preempted request keeps its deadline; the bound
    holds for each of its waits.

    Preemption victim: the running request with the most slack, the time left until its
    next deadline. Before its first token: its TTFT deadline - now. After it, with a TPOT
    target: first_token_time + tpot_target * (tokens generated) - now (token k, counting
    from 0, is due tpot_target * k after the first); with no target left to miss, infinite.
    Among equal slack, the newest admitted (it has done the least work).
    """

    name = "edf"

    def __init__(
        self, late_penalty_ms: float = 5000.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (late_penalty_ms > 0 and math.isfinite(late_penalty_ms)):
            raise ValueError(
                f"edf late penalty must be > 0 and finite (late requests fall behind on-time "
                f"ones, by a bounded amount), got {late_penalty_ms}"
            )
        self.late_penalty = late_penalty_ms / 1000
        self.clock = clock
        self._next_late = math.inf  # when the next queued on-time request turns late

    @classmethod
    def create(cls, options: PolicyOptions) -> EDFPolicy:
        return cls(options.edf_late_penalty_ms, clock=options.clock)

    @staticmethod
    def deadline(request: Request) -> float:
        """arrival + TTFT target, in seconds; inf without a target."""
        target = request.ttft_target_ms
        return math.inf if target is None else request.arrival_time + target / 1000

    def key(self, request: Request, now: float | None = None) -> tuple:
        now = self.clock() if now is None else now
        deadline = self.deadline(request)
        late = deadline < now
        return (deadline + self.late_penalty if late else deadline, request.arrival_seq)

    def enqueue(self, waiting: deque[Request], request: Request, *, preempted: bool) -> None:
        now = self.clock()
        deadline = self.deadline(request)
        if deadline >= now:
            self._next_late = min(self._next_late, deadline)
        key = self.key(request, now)
        i = bisect.bisect_right(waiting, key, key=lambda r: self.key(r, now))
        waiting.insert(i, request)

    def reorder(self, waiting: deque[Request]) -> None:
        now = self.clock()
        if now <= self._next_late:
            return  # no queued request has turned late: every key is as it was
        ordered = sorted(waiting, key=lambda r: self.key(r, now))
        waiting.clear()
        waiting.extend(ordered)
        on_time = [d for d in map(self.deadline, ordered) if d >= now]
        self._next_late = min(on_time, default=math.inf)

    def slack(self, request: Request, now: float) -> float:
        """Seconds until the request's next deadline (negative once missed; inf: none)."""
        if not request.output_token_ids:
            return self.deadline(request) - now
        if request.tpot_target_ms is None:
            return math.inf
        # Set by the engine with the first token; a scheduler driven without one (tests)
        # counts from arrival.
        first = request.metrics.first_token_time
        first = request.arrival_time if first is None else first
        return first + request.tpot_target_ms / 1000 * len(request.output_token_ids) - now

    def victim(self, running: list[Request]) -> Request:
        now = self.clock()
        return running[max(range(len(running)), key=lambda i: (self.slack(running[i], now), i))]


def check_policy_name(name: str) -> None:
    """A one-line error for a name no policy has."""
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {name!r}")


def make_policy(
    name: str,
    *,
    srpf_aging: float = 16.0,
    edf_late_penalty_ms: float = 5000.0,
    clock: Callable[[], float] = time.monotonic,
) -> SchedulingPolicy:
    """The policy called `name`; `clock` (wall seconds) is edf's, injectable for tests."""
    check_policy_name(name)
    return POLICIES[name].create(PolicyOptions(srpf_aging, edf_late_penalty_ms, clock))


# ---- admission ----------------------------------------------------------------------------


class OutputLengths:
    """The output lengths of the last `window` requests that finished (stop or length, not
    aborted), and their `quantile`: what `predicted` admission expects a new request to
    generate. Nearest rank: the smallest observed length with at least `quantile` of the
    window at or below it. Kept sorted as it goes, so a prediction costs nothing."""

    def __init__(self, quantile: float = 0.9, window: int = 1000) -> None:
        if not 0 < quantile <= 1:
            raise ValueError(f"admission_quantile must be in (0, 1], got {quantile}")
        if window < 1:
            raise ValueError(f"the output length window must be >= 1, got {window}")
        self.quantile = quantile
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        self.prediction: int | None = None  # None until a request has finished

    def observe(self, num_output_tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._sorted.pop(bisect.bisect_left(self._sorted, self._recent[0]))
        self._recent.append(num_output_tokens)
        bisect.insort(self._sorted, num_output_tokens)
        rank = math.ceil(self.quantile * len(self._sorted))
        self.prediction = self._sorted[max(rank, 1) - 1]


def reserved_tokens(admission: str, request: Request, prediction: int | None) -> int:
    """Tokens of K/V the request is promised pages for when admitted: none (greedy: pages
    are taken as tokens come), every position it can ever fill (reserve: prompt + max_tokens
    - 1, the last sampled token is never fed), or the prompt + the predicted output length
    (predicted; max_tokens until a request has finished). Never fewer than it holds now
    (a preempted request may have outgrown its prediction)."""
    if admission == "greedy":
        return 0
    if admission not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {list(ADMISSION_MODES)}, got {admission!r}")
    output = request.max_tokens
    if admission == "predicted" and prediction is not None:
        output = min(output, prediction)
    return max(request.num_prompt_tokens + output - 1, request.num_tokens)
