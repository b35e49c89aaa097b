"""The jaxcb system of the offline benchmark: `jaxcb.LLM(...).generate` on the whole workload.

Besides the wall time, each pass reports what the engine did during it (steps, buckets,
padding, preemptions, host and device seconds) from the difference of two `llm.stats()`
snapshots, and TTFT / inter-token latency from the request outputs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from jaxcb.bench.base import BenchContext, PassResult, check_lengths
from jaxcb.engine.step_trace import recording, trace_meta


class JaxcbSystem:
    """`jaxcb.LLM(...).generate(prompts, params, use_tqdm=False)`; compiling is at build.

    Every pass starts with an empty prefix cache: the passes send the same prompts, and a pass
    must not reuse what the previous one (or the warm-up) cached."""

    name = "jaxcb"

    def __init__(self, ctx: BenchContext) -> None:
        from jaxcb import LLM, SamplingParams

        self.requests, self.stops = ctx.workload.requests, ctx.workload.stops
        self.prompts = [r.prompt_token_ids for r in self.requests]
        self.params = [
            SamplingParams(
                max_tokens=r.max_tokens,
                temperature=0.0,
                ignore_eos=ctx.workload.ignore_eos,
                stop_token_ids=list(self.stops),
            )
            for r in self.requests
        ]
        self.record_trace = ctx.record_trace
        self.last_trace: list[dict[str, Any]] | None = None
        start = time.perf_counter()
        model = ctx.jaxcb_model or ctx.model_dir
        self.llm = LLM(model, config=ctx.jaxcb_config, **ctx.jaxcb_overrides)
        self.build_s = time.perf_counter() - start
        k = max(1, min(ctx.warmup_requests, len(self.prompts)))
        start = time.perf_counter()
        self.llm.generate(self.prompts[:k], self.params[:k], use_tqdm=False)
        self.warmup_s = time.perf_counter() - start

    def info(self) -> dict[str, Any]:
        stats = self.llm.stats()
        return dict(
            config=self.llm.config.to_dict(),
            build_seconds=self.build_s,  # load + compile
            compile_seconds=stats["compile_seconds"],
            compile_seconds_per_bucket=stats["compile_seconds_per_bucket"],
            warmup_seconds=self.warmup_s,
            kv_pages_total=stats["kv_pages_total"],
            compile_cache=stats.get("compile_cache"),  # buckets compiled / loaded from disk
        )

    def trace_meta(self) -> dict[str, Any]:
        return trace_meta(self.llm)

    def run_pass(self) -> PassResult:
        self.llm.reset_prefix_cache()
        before = self.llm.stats()
        trace = recording(self.llm) if self.record_trace else contextlib.nullcontext([])
        with trace as steps:
            start = time.perf_counter()
            outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
            wall = time.perf_counter() - start
        if self.record_trace:
            self.last_trace = steps
        token_ids = [list(o.token_ids) for o in outs]
        check_lengths(self.name, token_ids, self.requests, self.stops)
        extra = engine_stats_delta(before, self.llm.stats())
        extra.update(latency_summary(outs))
        if self.record_trace:
            extra["batch_padding_tokens"] = sum(st.get("batch_padding", 0) for st in steps)
        return PassResult(wall, token_ids, extra)

    def close(self) -> None:
        self.llm = None


def latency_summary(outputs: list[Any]) -> dict[str, float]:
    """TTFT and inter-token latency of finished `RequestOutput`s (engine clock, seconds):
    mean and median TTFT, and the mean gap between consecutive tokens pooled over requests."""
    ttft, span, gaps = [], 0.0, 0
    for out in outputs:
        m = out.metrics
        if m.first_token_time is None:
            continue
        ttft.append(m.first_token_time - m.arrival_time)
        n = len(out.outputs[0].token_ids)
        if n > 1 and m.last_token_time is not None:
            span += m.last_token_time - m.first_token_time
            gaps += n - 1
    return dict(
        mean_ttft_s=statistics.mean(ttft) if ttft else 0.0,
        median_ttft_s=statistics.median(ttft) if ttft else 0.0,
        mean_itl_s=span / gaps if gaps else 0.0,
    )


def engine_stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one `generate` call did, from two cumulative `llm.stats()` snapshots."""
    hist = {
        int(t): n - before["bucket_histogram"].get(t, 0)
        for t, n in after["bucket_histogram"].items()
        if n - before["bucket_histogram"].get(t, 0)
    }

    def slots_and_real(stats: dict[str, Any]) -> tuple[int, float]:
        slots = sum(int(t) * n for t, n in stats["bucket_histogram"].items())
        return slots, slots * (1.0 - stats["padding_fraction"])

    slots0, real0 = slots_and_real(before)
    slots1, real1 = slots_and_real(after)
    slots, real = slots1 - slots0, real1 - real0
    return dict(
        steps=after["steps"] - before["steps"],
        bucket_histogram=hist,
        token_slots=slots,
        tokens_scheduled=round(real),
        padding_fraction=(slots - real) / slots if slots else 0.0,
        preemptions=after["preemptions"] - before["preemptions"],
        **{  # preemption by swap (engine/sched/swap.py)
            k: after[k] - before[k]
            for k in ("swapped_out_requests", "swap_fallbacks", "swap_seconds")
            if k in after
        },
        host_seconds=after["host_seconds"] - before["host_seconds"],
        device_seconds=after["device_seconds"] - before["device_seconds"],
        kv_pages_peak=after["kv_pages_peak"],
    )
