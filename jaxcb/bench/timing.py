"""Timing calls for the micro-benchmarks: every timed call waits for its result.

`time_calls` times one function (a first call compiles a jitted one, untimed with the
warm-up); `time_interleaved` times several compiled ones call by call in turns, so that load
from other processes falls on all of them alike; `median_seconds` is the median alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Timing:
    """The seconds of every timed call, and the last call's result (to check it)."""

    seconds: tuple[float, ...]
    output: Any

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)


def _timed_call(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return time.perf_counter() - start, out


def time_calls(
    fn: Callable[..., Any],
    args: tuple = (),
    *,
    iters: int,
    warmup: int = 1,
    kwargs: Mapping[str, Any] | None = None,
) -> Timing:
    """fn(*args, **kwargs) called once (the compile of a jitted fn) and `warmup` more times
    untimed, then `iters` times timed."""
    kwargs = kwargs or {}
    for _ in range(warmup + 1):
        _, out = _timed_call(fn, args, kwargs)
    seconds = []
    for _ in range(iters):
        elapsed, out = _timed_call(fn, args, kwargs)
        seconds.append(elapsed)
    return Timing(tuple(seconds), out)


def time_interleaved(
    fns: Mapping[str, Callable[..., Any]],
    args: tuple = (),
    *,
    iters: int,
    warmup: int = 1,
    kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Timing]:
    """Already compiled functions (no call compiles), each called in turn: `warmup` untimed
    rounds, then `iters` timed ones; a Timing per name."""
    kwargs = kwargs or {}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    outputs: dict[str, Any] = {}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            elapsed, outputs[name] = _timed_call(fn, args, kwargs)
            if i >= warmup:
                seconds[name].append(elapsed)
    return {name: Timing(tuple(seconds[name]), outputs[name]) for name in fns}


def median_seconds(fn: Callable[..., Any], args: tuple, iters: int, warmup: int = 1) -> float:
    """Median seconds of one call of fn(*args), after a first call (the compile) and `warmup`
    more: `time_calls(...).median`."""
    return time_calls(fn, args, iters=iters, warmup=warmup).median
