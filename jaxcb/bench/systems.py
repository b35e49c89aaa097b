"""The systems an offline benchmark compares, behind one small interface.

A system is built once from a `BenchContext` (model, workload, dtype, options): everything
slow and untimed happens there (loading, compiling, a warm-up). Then `run_pass()` serves the
whole workload once and returns a `PassResult`; the caller times nothing itself, so each system
decides exactly what its timed region is. Systems take turns pass by pass in one process, so
a noisy neighbour slows them alike.

To add a system (issue 7: vLLM, which must run in its own venv as a subprocess started in
`__init__` and driven one pass per `run_pass`), write a class with `name`, `info()`,
`run_pass()` and `close()` and register its constructor in `SYSTEMS`.

Every system must return, per request in workload order, exactly `max_tokens` greedy tokens
(EOS ignored); `check_lengths` enforces it, so a system that stopped early is an error rather
than a flattering number.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jaxcb.bench.workloads import BenchRequest, Workload

Log = Callable[[str], None]


@dataclass
class BenchContext:
    """What every system is built from."""

    model_dir: Path
    workload: Workload
    dtype: str  # "float32" | "bfloat16", for every system alike
    log: Log = print
    jaxcb_config: str | Path | None = None  # YAML preset
    jaxcb_overrides: dict[str, Any] = field(default_factory=dict)  # flat config fields
    warmup_requests: int = 4  # untimed requests served before the timed passes
    hf_static_batch_size: int = 8
    hf_cb_options: dict[str, Any] = field(default_factory=dict)  # ContinuousBatchingConfig
    _hf_model: Any = None

    def hf_model(self) -> Any:
        """The transformers model, loaded once and shared by the HF systems, EOS disabled."""
        if self._hf_model is None:
            import torch
            from transformers import AutoModelForCausalLM

            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).eval()
            # generate() fills every unset (None) field from the model's generation config;
            # clearing the EOS there is what makes "no EOS stop" stick.
            model.generation_config.eos_token_id = None
            self._hf_model = model
        return self._hf_model


@dataclass
class PassResult:
    wall_s: float  # the timed region
    token_ids: list[list[int]]  # per request, its max_tokens useful tokens
    extra: dict[str, Any] = field(default_factory=dict)  # system-specific, JSON-able


class System(Protocol):
    name: str

    def info(self) -> dict[str, Any]: ...

    def run_pass(self) -> PassResult: ...

    def close(self) -> None: ...


def check_lengths(name: str, token_ids: list[list[int]], requests: list[BenchRequest]) -> None:
    """Raise RuntimeError unless request i got exactly requests[i].max_tokens tokens."""
    bad = [
        (i, len(t), r.max_tokens)
        for i, (t, r) in enumerate(zip(token_ids, requests, strict=True))
        if len(t) != r.max_tokens
    ]
    if bad:
        raise RuntimeError(
            f"{name}: {len(bad)} requests did not return exactly max_tokens tokens "
            f"(index, got, wanted): {bad[:5]}; is EOS really ignored?"
        )


# ---- jaxcb ------------------------------------------------------------------------------


class JaxcbSystem:
    """`jaxcb.LLM(...).generate(prompts, params, use_tqdm=False)`; compiling is at build."""

    name = "jaxcb"

    def __init__(self, ctx: BenchContext) -> None:
        from jaxcb import LLM, SamplingParams

        self.requests = ctx.workload.requests
        self.prompts = [r.prompt_token_ids for r in self.requests]
        self.params = [
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in self.requests
        ]
        start = time.perf_counter()
        self.llm = LLM(ctx.model_dir, config=ctx.jaxcb_config, **ctx.jaxcb_overrides)
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
        )

    def run_pass(self) -> PassResult:
        before = self.llm.stats()
        start = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        wall = time.perf_counter() - start
        token_ids = [list(o.token_ids) for o in outs]
        check_lengths(self.name, token_ids, self.requests)
        return PassResult(wall, token_ids, engine_stats_delta(before, self.llm.stats()))

    def close(self) -> None:
        self.llm = None


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
        host_seconds=after["host_seconds"] - before["host_seconds"],
        device_seconds=after["device_seconds"] - before["device_seconds"],
        kv_pages_peak=after["kv_pages_peak"],
    )


# ---- Hugging Face transformers ------------------------------------------------------------


class HFContinuousBatching:
    """transformers' ContinuousBatchingManager, one `add_request` per request with its own
    `max_new_tokens`. Each pass builds a fresh manager, serves a few warm-up requests through
    it (which also waits out its cache allocation), then times all requests in."""

    name = "hf-cb"

    def __init__(self, ctx: BenchContext) -> None:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.ctx, self.log = ctx, ctx.log
        self.requests = ctx.workload.requests
        self.model = ctx.hf_model()
        self.warmup = self.requests[: max(1, min(ctx.warmup_requests, len(self.requests)))]
        self.hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in self.requests),
            max_generated_length=max(r.max_tokens for r in self.requests),
            num_requests=len(self.requests),
        )
        options = dict(ctx.hf_cb_options)
        page_size = options.setdefault("page_size", 256)
        # On CPU, transformers sizes the cache at 60% of RAM: far too greedy on a shared
        # machine. Room for every request at once instead, so nothing is ever offloaded.
        options.setdefault(
            "num_blocks",
            sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) for r in self.requests),
        )
        self.options = options
        self.resolved: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return dict(
            options=self.options,
            resolved_config=self.resolved,
            attn_implementation=self.model.config._attn_implementation,
        )

    def run_pass(self) -> PassResult:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)  # -1: no EOS
        manager = self.model.init_continuous_batching(
            generation_config=gen,
            continuous_batching_config=ContinuousBatchingConfig(**self.options),
            workload_hints=self.hints,
        )
        manager.start()
        try:
            self._serve(manager, self.warmup, "warmup-")
            start = time.perf_counter()
            token_ids = self._serve(manager, self.requests, "", progress=True)
            wall = time.perf_counter() - start
            cfg = manager.continuous_batching_config
            self.resolved = {
                k: getattr(cfg, k)
                for k in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")
            }
        finally:
            manager.stop(block=True)
            manager.destroy()
        check_lengths(self.name, token_ids, self.requests)
        return PassResult(wall, token_ids)

    def _serve(self, manager, requests, prefix: str, progress: bool = False) -> list[list[int]]:
        for i, r in enumerate(requests):
            rid = manager.add_request(
                r.prompt_token_ids, request_id=f"{prefix}{i}", max_new_tokens=r.max_tokens
            )
            if rid is None:
                raise RuntimeError(f"{self.name}: the manager dropped request {i}")
        results: dict[str, list[int]] = {}
        last_log = time.perf_counter()
        while len(results) < len(requests):
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(
                        f"{self.name}: generation thread stopped with {len(results)} of "
                        f"{len(requests)} requests back"
                    )
                continue
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"{self.name}: request {out.request_id} failed: {out.error}")
                results[out.request_id] = list(out.generated_tokens)
            if progress and time.perf_counter() - last_log > 20:
                self.log(f"  {self.name}: {len(results)}/{len(requests)} requests back")
                last_log = time.perf_counter()
        return [results[f"{prefix}{i}"] for i in range(len(requests))]

    def close(self) -> None:
        self.model = None


class HFStaticBatching:
    """`model.generate` on left-padded batches in arrival order, each run for its longest
    request's `max_new_tokens`. Useful output is each request's own max_tokens; the rest
    (`raw_generated_tokens` minus useful) is the waste static batching pays."""

    name = "hf-static"

    def __init__(self, ctx: BenchContext) -> None:
        import torch

        self.torch, self.log = torch, ctx.log
        self.requests = ctx.workload.requests
        self.batch_size = ctx.hf_static_batch_size
        self.model = ctx.hf_model()
        warm = self.requests[: max(1, min(ctx.warmup_requests, len(self.requests)))]
        self._generate(warm, max_new_tokens=4)

    def info(self) -> dict[str, Any]:
        return dict(
            batch_size=self.batch_size,
            attn_implementation=self.model.config._attn_implementation,
        )

    def _generate(self, batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        from transformers import GenerationConfig

        torch = self.torch
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # pad id 0, masked out
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding: every row's last token at the end
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n :] = 1
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
        )
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, generation_config=gen)
        return out[:, width:].tolist()

    def run_pass(self) -> PassResult:
        token_ids: list[list[int]] = []
        raw = 0
        start = last_log = time.perf_counter()
        for b in range(0, len(self.requests), self.batch_size):
            batch = self.requests[b : b + self.batch_size]
            longest = max(r.max_tokens for r in batch)
            rows = self._generate(batch, longest)
            raw += sum(len(row) for row in rows)
            token_ids += [row[: r.max_tokens] for row, r in zip(rows, batch, strict=True)]
            if time.perf_counter() - last_log > 20:
                self.log(f"  {self.name}: {len(token_ids)}/{len(self.requests)} requests done")
                last_log = time.perf_counter()
        wall = time.perf_counter() - start
        check_lengths(self.name, token_ids, self.requests)
        return PassResult(wall, token_ids, dict(raw_generated_tokens=raw))

    def close(self) -> None:
        self.model = None


#: name -> constructor. The order here is the order systems take their turns in.
SYSTEMS: dict[str, Callable[[BenchContext], System]] = {
    "jaxcb": JaxcbSystem,
    "hf-cb": HFContinuousBatching,
    "hf-static": HFStaticBatching,
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
