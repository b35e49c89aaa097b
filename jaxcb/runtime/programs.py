"""The runner's compiled programs: the step (runtime/step.py) jitted for the runner's
shardings and compiled per bucket, and the sampling program compiled per sequence-row count
S; what they are traced on, their compile seconds, and the background compile
(compile_queue.py) that lets the engine run before every program is compiled.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.engine.buckets import Bucket
from jaxcb.models.base import AttentionBackend, ModelSpec, Params
from jaxcb.runtime import step as step_module
from jaxcb.runtime.compile_queue import CompileQueue
from jaxcb.runtime.kv_cache import DeviceState
from jaxcb.runtime.step_input import (
    LARGE_FIELDS,
    empty_step_input,
    pack_small,
    sampling_input,
    small_layout,
)

logger = logging.getLogger(__name__)

#: Where XLA's GPU compiler keeps the kernels it compiled, one file per group of programs
#: (`kernel_cache_options`): a kernel another program of the group compiled already is
#: reused rather than put through ptxas again (two buckets of one token count share their
#: layers' kernels). The Llama-3-8B H100 preset's buckets compiled in 21.1-22.3 s instead
#: of 26.1-27.7 (a 2-core AMD EPYC Zen 5 host), the programs unchanged.
_KERNEL_CACHE: dict[str, Any] = {"dir": None, "locks": {}}
_KERNEL_CACHE_LOCK = threading.Lock()


def kernel_cache_options(group: str) -> tuple[dict[str, Any], threading.Lock]:
    """XLA compile options that share a GPU kernel cache file among a group's programs, and
    the lock to hold while compiling with them: XLA rewrites the file after each compile
    (read, merge, write: no locking of its own), so one group's programs compile one at a
    time, in this process or in the one temporary directory it removes at exit. Used while
    jax's persistent compilation cache is off (the AOT compile; `StepPrograms._compile`)."""
    with _KERNEL_CACHE_LOCK:
        if _KERNEL_CACHE["dir"] is None:
            _KERNEL_CACHE["dir"] = Path(tempfile.mkdtemp(prefix="jaxcb-kernels-"))
            atexit.register(shutil.rmtree, _KERNEL_CACHE["dir"], ignore_errors=True)
        lock = _KERNEL_CACHE["locks"].setdefault(group, threading.Lock())
    options = {
        "xla_gpu_kernel_cache_file": str(_KERNEL_CACHE["dir"] / f"{group}.bin"),
        "xla_gpu_enable_llvm_module_compilation_parallelism": True,
    }
    return options, lock


class StepPrograms:
    """The step per bucket and the sampling program per S, compiled ahead of time."""

    def __init__(
        self,
        spec: ModelSpec,
        params: Params,
        state: DeviceState,
        *,
        attention: AttentionBackend,
        num_top_logprobs: int,
        scan_layers: bool,
        platform: str,
        pages_per_seq: int,
        max_model_len: int,
        param_shardings: Any,
        state_shardings: Any,
        logits_shardings: tuple,
        replicated: jax.sharding.Sharding,
    ) -> None:
        """`params`, `state`: the runner's (arrays, or ShapeDtypeStructs for an abstract
        runner); the programs are traced on their shapes and shardings."""
        self.spec = spec
        self.pages_per_seq = pages_per_seq
        self.max_model_len = max_model_len
        # The static arguments are bound here: jit takes no keyword arguments alongside
        # in_shardings.
        step = functools.partial(
            step_module.packed_step,
            spec=spec,
            attention=attention,
            num_top_logprobs=num_top_logprobs,
            logits_shardings=logits_shardings,
            scan_layers=scan_layers,
        )
        logits_sharding = logits_shardings[-1] if logits_shardings else replicated
        self._step = jax.jit(
            step,
            static_argnums=(5,),  # the StepInput buffers' layout
            donate_argnames=("state",),
            in_shardings=(
                param_shardings,
                state_shardings,
                *(replicated,) * 3,  # StepInput: two buffers and its large arrays
            ),
            out_shardings=(
                replicated,  # the greedy tokens
                replicated,
                logits_sharding,  # for the sampling program
                state_shardings,
                replicated,  # the sampled tokens for the next step (async scheduling)
            ),
        )
        self._sample = jax.jit(
            functools.partial(
                step_module.sample_step, num_top_logprobs=num_top_logprobs, platform=platform
            ),
            donate_argnums=(2,),  # the step's next-step token buffer, rewritten
            in_shardings=(logits_sharding, *(replicated,) * 3),
            out_shardings=replicated,
        )
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self._compiled_samplers: dict[int, jax.stages.Compiled] = {}  # by sequence rows S
        # The sampled-token buffer's rows (the largest bucket's S: one shape for every
        # bucket's step; the runner's `_sampled`).
        self.num_sampled_rows = 0
        # Seconds per token bucket (its sequence-row variants summed), per bucket, and per
        # sampling program (by S; also counted in the first bucket of that S, the one whose
        # start-up compiled it).
        self.compile_seconds: dict[int, float] = {}
        self.bucket_compile_seconds: dict[Bucket, float] = {}
        self.sampler_compile_seconds: dict[int, float] = {}
        self.lower_seconds: dict[Bucket, float] = {}
        # What the programs are traced on: the params' and the state's shapes and shardings
        # (the state a step donates is gone after it; a background compile traces later).
        self._abstract = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (params, state)
        )
        self._queue: CompileQueue | None = None  # programs compiling in the background
        self._queue_keys: dict[Bucket | int, tuple[Bucket, int | None]] = {}
        self._kernel_cache = platform == "gpu"  # (kernel_cache_options)

    def compile(
        self,
        buckets: tuple[Bucket, ...],
        progress: bool = False,
        threads: int = 1,
        ready_after: int | None = None,
    ) -> float:
        """AOT-compile the step for every bucket and the sampling program of every sequence-
        row count; returns the seconds summed over programs (each one's lowering and
        compile; with threads, more than the wall time).

        `threads` > 1: the programs are lowered one after another (tracing is Python and
        holds the GIL), then compiled that many at a time (XLA's compiler releases it).
        `ready_after`: compile the first that many buckets before returning and the others
        on a background thread, in order (runtime/compile_queue.py); a step whose program
        is not compiled yet waits for it. The seconds returned are the first buckets'."""
        rows = max(b.num_seqs for b in buckets)
        if (self._compiled or self._queue) and rows > self.num_sampled_rows:
            raise ValueError(
                f"buckets of {rows} sequence rows need a larger sampled-token buffer than the "
                f"{self.num_sampled_rows} rows already compiled: compile every bucket at once"
            )
        if rows > self.num_sampled_rows:  # adopted samplers read a smaller buffer: not those
            self._compiled_samplers.clear()
        self.num_sampled_rows = max(self.num_sampled_rows, rows)
        # Each bucket's step, and the sampling program of each S not compiled yet, keyed
        # (bucket, None) and (bucket, S) for the first bucket of that S.
        keys: list[tuple[Bucket, int | None]] = []
        for bucket in buckets:
            keys.append((bucket, None))
            seqs = bucket.num_seqs
            if seqs not in self._compiled_samplers and all(k[1] != seqs for k in keys):
                keys.append((bucket, seqs))
        later: list[tuple[Bucket, int | None]] = []
        if ready_after is not None and ready_after < len(buckets):
            split = keys.index((buckets[ready_after], None))
            keys, later = keys[:split], keys[split:]
        lowered = {key: self._lower(key) for key in keys}
        # One group per token count (its buckets' steps share their layers' kernels) and one
        # of the sampling programs; a group compiles in order, the groups side by side.
        groups: dict[str, list[tuple[Bucket, int | None]]] = {}
        for key in keys:
            groups.setdefault(self._group(key), []).append(key)

        def compile_group(group: list[tuple[Bucket, int | None]]) -> list[tuple]:
            return [(key, *self._compile(key, *lowered[key])) for key in group]

        from tqdm.auto import tqdm

        total = 0.0
        bar = tqdm(
            total=len(keys),
            desc="compiling buckets",
            unit="program",
            leave=False,
            disable=not progress,
        )
        with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
            for results in (pool.map if pool else map)(compile_group, groups.values()):
                for key, compiled, seconds in results:
                    self._record(key, compiled, seconds, lowered[key][1])
                    total += seconds
                bar.update(len(results))
        bar.close()
        if later:
            self._queue_keys = {(b if s is None else s): (b, s) for b, s in later}
            self._queue = CompileQueue(list(self._queue_keys), self._compile_later)
            logger.info("compiling %d more programs in the background", len(later))
        return total

    def _trace(self, key: tuple[Bucket, int | None]) -> jax.stages.Traced:
        bucket, num_seqs = key
        return self.trace_step(bucket) if num_seqs is None else self.trace_sampler(num_seqs)

    @staticmethod
    def _group(key: tuple[Bucket, int | None]) -> str:
        bucket, num_seqs = key
        return f"step-{bucket.num_tokens}" if num_seqs is None else "sampling"

    def _lower(self, key: tuple[Bucket, int | None]) -> tuple[jax.stages.Lowered, float]:
        """A program traced and lowered, and the seconds that took."""
        t0 = time.perf_counter()
        return self._trace(key).lower(), time.perf_counter() - t0

    def _compile(
        self, key: tuple[Bucket, int | None], lowered: jax.stages.Lowered, lower_seconds: float
    ) -> tuple[jax.stages.Compiled, float]:
        """A lowered program compiled (on GPU with its group's kernel cache), and the seconds
        of lowering and compiling it."""
        t0 = time.perf_counter()
        # Not with jax's persistent cache on: its keys include the compile options, and a
        # temporary path would miss every entry (a warm start loads the programs anyway).
        if not self._kernel_cache or jax.config.jax_compilation_cache_dir:
            compiled = lowered.compile()
        else:
            options, lock = kernel_cache_options(self._group(key))
            with lock:
                compiled = lowered.compile(options)
        return compiled, lower_seconds + time.perf_counter() - t0

    def _record(
        self,
        key: tuple[Bucket, int | None],
        compiled: jax.stages.Compiled,
        seconds: float,
        lower_seconds: float,
    ) -> None:
        """Keep a compiled program and its seconds (the stats and the start-up log's)."""
        bucket, num_seqs = key
        t = bucket.num_tokens
        if num_seqs is None:
            self.lower_seconds[bucket] = lower_seconds
            self._compiled[bucket] = compiled
            logger.info("compiled bucket T=%d S=%d in %.2fs", t, bucket.num_seqs, seconds)
        else:
            self._compiled_samplers[num_seqs] = compiled
            self.sampler_compile_seconds[num_seqs] = seconds
            logger.info("compiled sampling for S=%d in %.2fs", num_seqs, seconds)
        self.compile_seconds[t] = self.compile_seconds.get(t, 0.0) + seconds
        self.bucket_compile_seconds[bucket] = self.bucket_compile_seconds.get(bucket, 0.0) + seconds

    def _compile_later(self, program: Bucket | int) -> jax.stages.Compiled:
        """The background queue's compile of one program (a step's bucket, or a sampling
        program's S): traced on the abstract params and state, as the state the engine's
        steps donate may be gone by then."""
        key = self._queue_keys[program]
        lowered, lower_seconds = self._lower(key)
        compiled, seconds = self._compile(key, lowered, lower_seconds)
        self._record(key, compiled, seconds, lower_seconds)
        return compiled

    def program(self, program: Bucket | int) -> jax.stages.Compiled:
        """A bucket's compiled step or an S's sampling program; one still in the background
        queue is moved to its front and waited for."""
        table = self._compiled if isinstance(program, Bucket) else self._compiled_samplers
        compiled = table.get(program)
        if compiled is None and self._queue is not None and program in self._queue:
            if not self._queue.done(program):
                logger.info(
                    "a step waits for its %s, compiling in the background",
                    f"bucket T={program.num_tokens} S={program.num_seqs}"
                    if isinstance(program, Bucket)
                    else f"sampling program for S={program}",
                )
            return self._queue.wait(program)
        return table[program] if compiled is None else compiled

    def adopt_samplers(self, other: StepPrograms) -> None:
        """Take `other`'s compiled sampling programs, so `compile` does not compile them
        again: the KV pool-sizing probe's (runtime/setup.py, aot.py), whose pool differs from
        this one's, but a sampling program never reads the pool. The same mesh's, before
        `compile`."""
        if self._compiled or self._queue:
            raise ValueError("sampling programs are adopted before anything is compiled")
        self.num_sampled_rows = other.num_sampled_rows
        self._compiled_samplers.update(other._compiled_samplers)

    def all_compiled(self) -> list[jax.stages.Compiled]:
        """Every program compiled so far: the steps, then the sampling programs."""
        return [*self._compiled.values(), *self._compiled_samplers.values()]

    def background_compile(self) -> tuple[int, float]:
        """(programs still compiling in the background, seconds spent on the ones done);
        (0, 0.0) when every program was compiled before the engine was ready."""
        if self._queue is None:
            return 0, 0.0
        return self._queue.pending, self._queue.seconds

    def close(self) -> None:
        """Stop the background compile (after the program it is on)."""
        if self._queue is not None:
            self._queue.stop()

    def trace_step(self, bucket: Bucket) -> jax.stages.Traced:
        """The step traced for the bucket's shapes: what `compile` lowers (its jaxpr names
        the Pallas kernels and the cost estimates they declare)."""
        example = empty_step_input(
            bucket,
            self.pages_per_seq,
            self.max_model_len,
            self.num_sampled_rows,
            vocab_size=self.spec.vocab_size,
        )
        layout = small_layout(example)  # (static: compiled into the bucket's step)
        ints, floats = pack_small(example)
        large = tuple(getattr(example, name) for name in LARGE_FIELDS)
        params, state = self._abstract
        return self._step.trace(params, state, ints, floats, large, layout)

    def trace_sampler(self, num_seqs: int) -> jax.stages.Traced:
        """The sampling program traced for S sequence rows (any bucket of that S)."""
        example = empty_step_input(
            Bucket(num_seqs, num_seqs),
            self.pages_per_seq,
            self.max_model_len,
            self.num_sampled_rows,
            vocab_size=self.spec.vocab_size,
        )
        logits = jax.ShapeDtypeStruct((num_seqs, self.spec.vocab_size), jnp.float32)
        return self._sample.trace(
            logits, example.logits_indices, example.prev_token_ids, sampling_input(example)
        )

    def compiled_step(self, bucket: Bucket) -> jax.stages.Compiled:
        """The bucket's compiled step (after `compile`): its memory_analysis and
        cost_analysis are what runtime/aot.py reports."""
        return self.program(bucket)

    def compiled_sampler(self, num_seqs: int) -> jax.stages.Compiled:
        """The compiled sampling program for S sequence rows (after `compile`)."""
        return self.program(num_seqs)
