"""Timing a jitted function for the micro-benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_seconds(fn: Callable[..., Any], args: tuple, iters: int, warmup: int = 1) -> float:
    """Median seconds of one call of fn(*args), after a first call (the compile) and `warmup`
    more; every call waits for its result."""
    for _ in range(warmup + 1):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
