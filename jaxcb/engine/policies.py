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

Pure Python, no jax.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from typing import ClassVar

from jaxcb.config import SCHEDULING_POLICIES
from jaxcb.engine.request import Request

POLICIES = SCHEDULING_POLICIES


class SchedulingPolicy:
    name: ClassVar[str] = ""

    def enqueue(self, waiting: deque[Request], request: Request, *, preempted: bool) -> None:
        raise NotImplementedError

    def victim(self, running: list[Request]) -> Request:
        """`running` is in admission order."""
        return running[-1]


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

    def key(self, request: Request) -> tuple:
        remaining = request.num_tokens - request.num_computed_tokens
        return (remaining + self.aging * request.arrival_step, request.arrival_seq)


def make_policy(name: str, *, srpf_aging: float = 16.0) -> SchedulingPolicy:
    makers: dict[str, Callable[[], SchedulingPolicy]] = {
        "fcfs": FCFSPolicy,
        "priority": PriorityPolicy,
        "srpf": lambda: SRPFPolicy(srpf_aging),
    }
    if name not in makers:
        raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {name!r}")
    return makers[name]()
