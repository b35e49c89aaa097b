"""Serving metrics from client-side timestamps, defined as `vllm bench serve` defines them.

Per request the client records (monotonic clock, seconds, from just before the POST):
TTFT = time of the first streamed chunk with content; ITL = the gaps between consecutive
content chunks; E2EL = time of the last content chunk (the request's latency); output tokens
from the server's `usage` (else the content chunks counted). From those:

  TPOT      per request (E2EL - TTFT) / (output tokens - 1), requests of one token left out
  ITL       pooled over all requests' gaps
  goodput   requests per second that met every SLO given (`--goodput ttft:MS tpot:MS
            e2el:MS`; a one-token request's TPOT counts as 0)
  throughput requests, output tokens and input + output tokens over the benchmark's duration
  peak      the most output tokens in any whole second, and the most requests in flight

Mean, median, standard deviation and the chosen percentiles are reported in milliseconds,
with `vllm bench serve`'s labels, so the printed blocks and saved JSON compare one to one.
Pure Python + NumPy; `tests/scripts/test_serving_metrics.py` checks it on synthetic timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class RequestResult:
    """What the client saw of one request. Times in seconds."""

    success: bool
    prompt_len: int
    output_len: int = 0  # generated tokens (usage.completion_tokens, else content chunks)
    ttft: float = 0.0  # from sending to the first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    latency: float = 0.0  # E2EL: from sending to the last content chunk
    start_time: float = 0.0  # when it was sent, from the benchmark's start
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    def chunk_times(self) -> list[float]:
        """Absolute times (from the benchmark's start) of its content chunks."""
        if not self.success:
            return []
        t = self.start_time + self.ttft
        times = [t]
        for gap in self.itl:
            t += gap
            times.append(t)
        return times


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput wants NAME:MS with NAME in ttft, tpot, e2el; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not ms > 0 or not math.isfinite(ms):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive number of ms")
        slos[name] = ms
    return slos


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, Any]:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, Any] = {
        f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0,
        f"median_{name}_ms": float(np.median(ms)) if ms.size else 0.0,
        f"std_{name}_ms": float(ms.std()) if ms.size else 0.0,
    }
    for p in percentiles:
        out[f"p{_pname(p)}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def peak_output_throughput(results: Sequence[RequestResult]) -> float:
    """The most content chunks (≈ output tokens) that arrived within one whole second."""
    times = [t for r in results for t in r.chunk_times()]
    if not times:
        return 0.0
    bins = np.bincount(np.floor(np.asarray(times)).astype(np.int64))
    return float(bins.max())


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once (sent, last content chunk not yet in)."""
    events = []
    for r in results:
        if r.success:
            events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts on ties
        level += delta
        peak = max(peak, level)
    return peak


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = (99,),
) -> dict[str, Any]:
    """Every aggregate `vllm bench serve` reports, from the per-request results."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    out: dict[str, Any] = dict(
        duration=duration_s,
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_output_throughput(results),
        max_concurrent_requests=peak_concurrency(results),
    )
    if goodput:
        good = 0
        for r in ok:
            seen = dict(ttft=r.ttft, tpot=r.tpot or 0.0, e2el=r.latency)
            good += all(seen[k] * 1e3 <= slo for k, slo in goodput.items())
        out["request_goodput"] = good / duration_s
    out |= _stats("ttft", [r.ttft for r in ok], percentiles)
    out |= _stats("tpot", tpots, percentiles)
    out |= _stats("itl", [g for r in ok for g in r.itl], percentiles)
    out |= _stats("e2el", [r.latency for r in ok], percentiles)
    return out


def format_report(
    metrics: dict[str, Any],
    *,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    selected: Sequence[str] = METRICS,
    percentiles: Sequence[float] = (99,),
) -> str:
    """The result block, with `vllm bench serve`'s labels."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate configured (RPS):", request_rate, ".2f")
    if math.isfinite(request_rate):
        row("Burstiness factor:", burstiness, ".2f")
    row("Benchmark duration (s):", metrics["duration"], ".2f")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"], ".2f")
    if "request_goodput" in metrics:
        row("Request goodput (req/s):", metrics["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", metrics["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    for name in selected:
        title, short = TITLES[name]
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", metrics[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pname(p)} {short} (ms):", metrics[f"p{_pname(p)}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
