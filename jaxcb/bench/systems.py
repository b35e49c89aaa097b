"""The systems an offline benchmark compares, behind one small interface.

A system is built once from a `BenchContext` (model, workload, dtype, options): everything
slow and untimed happens there (loading, compiling, a warm-up). Then `run_pass()` serves the
whole workload once and returns a `PassResult`; the caller times nothing itself, so each system
decides exactly what its timed region is. Systems take turns pass by pass in one process, so
a noisy neighbour slows them alike.

To add a system, write a class with `name`, `info()`, `run_pass()` and `close()` and register
its constructor in `SYSTEMS`. vLLM is one: it runs in its own venv (never a jaxcb dependency),
as a subprocess (bench/vllm_runner.py) started in `__init__` and driven one pass at a time;
llama.cpp another: a `llama-server` binary started in `__init__`, sent each pass over HTTP.

Every system must return, per request in workload order, exactly `max_tokens` greedy tokens
(EOS ignored), or, on a natural-length workload, the tokens up to and including the first stop
token; `check_lengths` enforces it, so a system that stopped early is an error rather than a
flattering number.

The systems live one family per module (jaxcb_system.py, hf_systems.py, vllm_system.py,
llamacpp_system.py) on the shared pieces of base.py; this module registers them and
re-exports what the benchmarks use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jaxcb.bench.base import BenchContext, Log, PassResult, System, check_lengths
from jaxcb.bench.hf_systems import HFContinuousBatching, HFStaticBatching
from jaxcb.bench.jaxcb_system import JaxcbSystem, engine_stats_delta, latency_summary
from jaxcb.bench.llamacpp_system import LlamaCppSystem
from jaxcb.bench.vllm_system import VLLM_RUNNER, VLLMSystem, vllm_environment

__all__ = [
    "SYSTEMS",
    "VLLM_RUNNER",
    "BenchContext",
    "HFContinuousBatching",
    "HFStaticBatching",
    "JaxcbSystem",
    "LlamaCppSystem",
    "Log",
    "PassResult",
    "System",
    "VLLMSystem",
    "check_lengths",
    "engine_stats_delta",
    "environment",
    "latency_summary",
    "vllm_environment",
]


#: name -> constructor. The order here is the order systems take their turns in.
SYSTEMS: dict[str, Callable[[BenchContext], System]] = {
    "jaxcb": JaxcbSystem,
    "hf-cb": HFContinuousBatching,
    "hf-static": HFStaticBatching,
    "vllm": VLLMSystem,
    "llama.cpp": LlamaCppSystem,
}


def environment() -> dict[str, Any]:
    """Library versions and the CPU facts a result depends on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("jax", "jaxlib", "torch", "transformers", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    out: dict[str, Any] = dict(
        versions=versions,
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        xla_flags=os.environ.get("XLA_FLAGS"),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    )
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import jax

        out["jax_backend"] = jax.default_backend()
        out["jax_devices"] = [d.device_kind for d in jax.devices()]
    except ImportError:
        pass
    return out
