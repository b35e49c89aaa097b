"""LLMEngine.stats(): the engine's counters, its KV pool and its runtime in one dict (what
`LLM.stats()`, the server's metrics and the benchmarks read)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Protocol

from jaxcb.config import EngineConfig
from jaxcb.engine.grammar import GrammarCompiler
from jaxcb.engine.interface import EngineInfo, KVUsage, Runner, SpecDecodeCounts
from jaxcb.engine.sched.base import BaseScheduler
from jaxcb.engine.sched.itl_controller import ITLController
from jaxcb.engine.sched.swap import Swapper


class StatsSource(Protocol):
    """What the stats read of an engine (LLMEngine is one)."""

    config: EngineConfig
    info: EngineInfo
    runner: Runner
    scheduler: BaseScheduler
    grammars: GrammarCompiler
    swapper: Swapper | None
    itl: ITLController | None
    loras: dict[int, Any]  # LoRA adapters known, by lora_int_id

    @property
    def async_scheduling(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def kv_usage(self) -> KVUsage: ...

    def spec_decode_counts(self) -> SpecDecodeCounts: ...


def engine_stats(
    engine: StatsSource, counters: Counter[str], bucket_hist: Counter[int]
) -> dict[str, Any]:
    """`counters`: the engine's running totals; `bucket_hist`: steps per token bucket."""
    s, info, kv = counters, engine.info, engine.kv_usage()
    spec = engine.spec_decode_counts()
    compiling, background_seconds = engine.runner.background_compile()
    slots, queries = s["token_slots"], s["prefix_queries"]
    lora = engine.scheduler.lora_slots
    return {
        "steps": s["steps"],
        "requests": s["requests"],
        "aborted": s["aborted"],
        "prompt_tokens": s["prompt_tokens"],
        "generated_tokens": s["generated_tokens"],
        "bucket_histogram": dict(sorted(bucket_hist.items())),
        "padding_fraction": (slots - s["tokens_scheduled"]) / slots if slots else 0.0,
        "quantization": info.quantization,
        "weight_bytes": info.weight_bytes,
        "kv_cache_bytes": info.kv_cache_bytes,
        # the pages' dtype (int8, float8_e4m3fn, float8_e5m2: codes with a float32 scale per
        # token and KV head) and one token's K and V over all layers, scales included
        "kv_cache_dtype": info.kv_cache_dtype,
        "kv_bytes_per_token": info.kv_bytes_per_token,
        # start-up's compile, plus what a background compile has done since (the server's
        # default: compile_in_background) and the programs it still has to compile
        "compile_seconds": info.compile_seconds + background_seconds,
        "programs_compiling": compiling,
        "compile_cache": dict(info.compile_cache),
        "compile_seconds_per_bucket": dict(info.compile_seconds_per_bucket),
        "kernels": {
            "attention": info.attention_backend,
            "matmul": info.matmul_backend,
            **info.cpu_kernels,
        },
        # speculative decoding (vLLM's spec_decode counters): steps' verified proposal
        # lists, their tokens, those kept, and the tokens each list brought on average
        "spec_decode": {
            "method": engine.config.speculative_config.method,
            **dataclasses.asdict(spec),
            "mean_acceptance_length": spec.mean_acceptance_length,
        },
        "preemptions": s["preemptions"],
        # computed tokens the preempted requests dropped (prefix cache hits not subtracted)
        "recomputed_tokens": s["recomputed_tokens"],
        "admitted_idle_pages": engine.scheduler.admitted_idle_pages,
        "predicted_output_len": engine.scheduler.predicted_output_len,
        "failed": s["failed"],
        # structured outputs: grammars compiled (schemas, regexes, ...), their seconds, and
        # constraints served from the cache instead
        "grammars_compiled": engine.grammars.num_compiled,
        "grammar_compile_seconds": engine.grammars.compile_seconds,
        "grammar_cache_hits": engine.grammars.cache_hits,
        # preemption by swap (engine/sched/swap.py): victims whose pages went to host memory,
        # of them resumed, host pages held now, victims recomputed for want of host pages
        "swapped_out_requests": engine.swapper.num_swapped_out if engine.swapper else 0,
        "swapped_in_requests": engine.swapper.num_swapped_in if engine.swapper else 0,
        "swap_pages_used": kv.num_swap_used,
        "swap_pages_total": kv.num_swap_pages,
        "swap_fallbacks": engine.swapper.num_fallbacks if engine.swapper else 0,
        "swap_seconds": s["swap_seconds"],
        "prefix_queries": queries,
        "prefix_hits": s["prefix_hits"],
        "prefix_hit_rate": s["prefix_hits"] / queries if queries else 0.0,
        "kv_pages_total": kv.num_pages,
        "kv_pool_sizing": info.kv_pool_sizing,
        "kv_pages_used": kv.num_used,
        "kv_pages_peak": kv.peak_used,
        "kv_pages_cached": kv.num_cached,
        "kv_pages_evicted": kv.num_evictions,
        "host_seconds": s["host_seconds"],
        "device_seconds": s["device_seconds"],
        # async scheduling: on or not, and the steps that waited for the previous step's
        # tokens first (rows with penalties read them on the host)
        "async_scheduling": engine.async_scheduling,
        "async_drains": s["async_drains"],
        "num_running": engine.num_running,
        "num_waiting": engine.num_waiting,
        # the ITL controller's token budget per step; max_num_batched_tokens without one
        "prefill_budget": (
            engine.itl.budget if engine.itl else engine.config.scheduler.max_num_batched_tokens
        ),
        # LoRA (engine/lora_slots.py): adapters known, in device slots now, and written
        # into a slot so far (first loads and swaps)
        "lora_adapters": len(engine.loras),
        "lora_slots_used": len(engine.scheduler.lora_slots.loaded) if lora else 0,
        "lora_loads": s["lora_loads"],
    }
