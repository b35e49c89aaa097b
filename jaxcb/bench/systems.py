"""The systems an offline benchmark compares, behind one small interface.

A system is built once from a `BenchContext` (model, workload, dtype, options): everything
slow and untimed happens there (loading, compiling, a warm-up). Then `run_pass()` serves the
whole workload once and returns a `PassResult`; the caller times nothing itself, so each system
decides exactly what its timed region is. Systems take turns pass by pass in one process, so
a noisy neighbour slows them alike.

To add a system, write a class with `name`, `info()`, `run_pass()` and `close()` and register
its constructor in `SYSTEMS`. vLLM is one: it runs in its own venv (never a jaxcb dependency),
as a subprocess (bench/vllm_runner.py) started in `__init__` and driven one pass at a time.

Every system must return, per request in workload order, exactly `max_tokens` greedy tokens
(EOS ignored); `check_lengths` enforces it, so a system that stopped early is an error rather
than a flattering number.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jaxcb.bench.trace import recording, trace_meta
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
    vllm_python: Path | None = None  # python of vLLM's own venv; None: no vllm system
    vllm_binding: str = "tuned"  # "tuned": OMP threads bound to 0-1 with Intel OpenMP
    record_trace: bool = False  # jaxcb keeps the step trace of its last pass
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
    """`jaxcb.LLM(...).generate(prompts, params, use_tqdm=False)`; compiling is at build.

    Every pass starts with an empty prefix cache: the passes send the same prompts, and a pass
    must not reuse what the previous one (or the warm-up) cached."""

    name = "jaxcb"

    def __init__(self, ctx: BenchContext) -> None:
        from jaxcb import LLM, SamplingParams

        self.requests = ctx.workload.requests
        self.prompts = [r.prompt_token_ids for r in self.requests]
        self.params = [
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in self.requests
        ]
        self.record_trace = ctx.record_trace
        self.last_trace: list[dict[str, Any]] | None = None
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
        check_lengths(self.name, token_ids, self.requests)
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
    import statistics

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


# ---- vLLM (CPU build, its own venv) ------------------------------------------------------

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_environment(python: Path, binding: str) -> dict[str, str]:
    """The environment shared/BENCHMARKS.md runs vLLM's CPU build with: offline, 4 GiB of KV
    cache, and for the "tuned" binding OpenMP threads bound to cores 0-1 with Intel's
    OpenMP runtime (the venv's libiomp5.so) preloaded."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4")
    env.pop("VIRTUAL_ENV", None)
    if binding == "tuned":
        # <venv>/bin/python is usually a symlink out of the venv: do not resolve it
        libiomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
        if not libiomp.is_file():
            raise RuntimeError(f"vllm binding 'tuned' needs {libiomp}: is this vLLM's venv?")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
        env["LD_PRELOAD"] = str(libiomp)
    elif binding != "default":
        raise ValueError(f"vllm binding must be 'tuned' or 'default', got {binding!r}")
    return env


class VLLMSystem:
    """vLLM's offline `LLM.generate` in its own venv (`--vllm-python`), run by
    bench/vllm_runner.py in a subprocess that loads the model once, then times one pass each
    time `run_pass` asks. Token-id prompts, `skip_tokenizer_init`, prefix cache reset per
    pass, max_model_len 2048 as BENCHMARKS.md runs it (more if the workload needs it)."""

    name = "vllm"
    READY_TIMEOUT_S = 900.0  # loading + torch.compile on a busy 2-core machine
    PASS_TIMEOUT_S = 3600.0

    def __init__(self, ctx: BenchContext) -> None:
        if ctx.vllm_python is None:
            raise ValueError("the vllm system needs --vllm-python (the python of vLLM's venv)")
        self.log, self.requests = ctx.log, ctx.workload.requests
        self.python, self.binding = Path(ctx.vllm_python), ctx.vllm_binding
        self.tmp = tempfile.TemporaryDirectory(prefix="jaxcb-vllm-")
        spec = Path(self.tmp.name) / "requests.json"
        spec.write_text(
            json.dumps(
                dict(
                    prompts=[r.prompt_token_ids for r in self.requests],
                    max_tokens=[r.max_tokens for r in self.requests],
                    warmup=ctx.warmup_requests,
                )
            )
        )
        self.log_path = Path(self.tmp.name) / "vllm.log"
        self._log_file = self.log_path.open("w")
        config = json.loads((Path(ctx.model_dir) / "config.json").read_text())
        max_position = config.get("max_position_embeddings", 2048)
        max_model_len = max(ctx.workload.max_seq_len, min(2048, max_position))
        self.proc = subprocess.Popen(
            [str(self.python), str(VLLM_RUNNER), "--model", str(ctx.model_dir), "--dtype",
             ctx.dtype, "--requests", str(spec), "--max-model-len", str(max_model_len)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env=vllm_environment(self.python, self.binding),
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self._receive("ready", self.READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _receive(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(self._failure(f"no {event!r} after {timeout:.0f}s")) from None
            if line is None:
                raise RuntimeError(self._failure(f"runner exited before {event!r}"))
            message = json.loads(line)
            if message.get("event") == event:
                return message
            if message.get("event") == "error":
                raise RuntimeError(self._failure(message.get("message", "error")))

    def _failure(self, what: str) -> str:
        self._log_file.flush()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return f"vllm: {what}; the end of its log ({self.log_path}):\n{tail}"

    def info(self) -> dict[str, Any]:
        return dict(
            python=str(self.python),
            binding=self.binding,
            version=self.ready.get("version"),
            load_seconds=self.ready.get("load_s"),
            warmup_seconds=self.ready.get("warmup_s"),
        )

    def run_pass(self) -> PassResult:
        self.proc.stdin.write("pass\n")
        self.proc.stdin.flush()
        message = self._receive("pass", self.PASS_TIMEOUT_S)
        token_ids = message["token_ids"]
        check_lengths(self.name, token_ids, self.requests)
        return PassResult(message["wall_s"], token_ids)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        self._log_file.close()
        self.tmp.cleanup()


#: name -> constructor. The order here is the order systems take their turns in.
SYSTEMS: dict[str, Callable[[BenchContext], System]] = {
    "jaxcb": JaxcbSystem,
    "hf-cb": HFContinuousBatching,
    "hf-static": HFStaticBatching,
    "vllm": VLLMSystem,
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
