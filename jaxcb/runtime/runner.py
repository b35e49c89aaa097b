"""ModelRunner: owns params and device state, compiles every bucket ahead of time, runs steps.

It is the engine's `Runner` (engine/interface.py): `prepare` packs a scheduled step into the
bucket's fixed-shape arrays, `execute` runs the bucket's compiled step on them (and, when
some row samples or asks for logprobs, the compiled sampling program of the bucket's
sequence-row count: runtime/step.py) and waits for its tokens; `dispatch` and `collect`
are its two halves, for async scheduling (the engine packs the next step while this one
runs).

The runner works on a mesh (runtime/sharding.py): one device, or `tensor_parallel_size`
devices over which the params and the KV pages are sharded. The step is jitted with explicit
in/out shardings (params as the rules say, KV pages by KV head, step inputs and sampled
tokens replicated), so the same buckets compile into one SPMD program per bucket.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.engine.buckets import Bucket
from jaxcb.engine.interface import StepResult
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.models.base import AttentionBackend, ModelSpec, Params
from jaxcb.models.cpu_params import prepare_cpu_params
from jaxcb.models.stacking import stack_layers
from jaxcb.runtime import sharding
from jaxcb.runtime import step as step_module
from jaxcb.runtime.compile_queue import CompileQueue
from jaxcb.runtime.distributed import collective
from jaxcb.runtime.kv_cache import abstract_state, init_state
from jaxcb.runtime.kv_swap import HostSwapPool
from jaxcb.runtime.prompt_logprobs import PromptLogprobsOutput
from jaxcb.runtime.step_input import (
    FLAG_PROMPT_TOP_LOGPROBS,
    FLAG_TOP_LOGPROBS,
    LARGE_FIELDS,
    StepInput,
    all_tokens_allowed,
    empty_step_input,
    no_penalties,
    pack_small,
    pack_step_input,
    sampling_input,
    small_layout,
)
from jaxcb.sampling import SamplingOutput

logger = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A dispatched step whose outputs are still (or may still be) computing."""

    token_ids: jax.Array  # i32[S]
    out: SamplingOutput | None  # None: a greedy step without logprobs (token_ids are it)
    prompt_out: PromptLogprobsOutput
    num_prompt_rows: int  # prompt logprob rows it computes (0: none)
    want_top: bool  # some sampled row wants its top logprobs
    want_prompt_top: bool  # some prompt logprob row wants its top-k


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        params: Params,
        infos: Params,
        *,
        kv_cache_dtype: jnp.dtype,
        num_pages: int,
        page_size: int,
        pages_per_seq: int,
        max_model_len: int,
        attention: AttentionBackend,
        num_top_logprobs: int,
        mesh: jax.sharding.Mesh | None = None,
        pack_matmuls: str | None = None,
        greedy_screen: bool = True,
        num_swap_pages: int = 0,
        abstract: bool = False,
        scan_layers: bool = True,
    ) -> None:
        """`infos`: the params' declarations (the family's `param_infos`: shapes, logical
        axes). `pack_matmuls`: a native matmul kernel ("amx", "avx512_bf16", "avx512") to run
        the matmuls of its dtype on, their weights packed for it (CPU, one device; see
        models/cpu_params.py). `greedy_screen`: with "avx512", also keep the bf16 screen of the
        float32 lm_head that finds greedy tokens at bf16 cost (if this CPU has AVX512-BF16).
        `num_swap_pages`: host slots for pages preempted by swap (0: none; kv_swap.py's
        HostSwapPool). `abstract`: `params` are jax.ShapeDtypeStructs and no KV pool is
        allocated; such a runner only compiles (`compile`, `compiled_step`) and cannot run a
        step: for a target that is not present (runtime/aot.py, on its compile-only
        devices), or to measure the compiled step's memory before the pool is sized.
        `scan_layers`: the step loops over the layers with a lax.scan (models/stacking.py),
        else unrolls them."""
        self.spec = spec
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.num_top_logprobs = num_top_logprobs
        self.mesh = mesh = mesh if mesh is not None else sharding.replica_mesh(1)
        tp = sharding.tensor_parallel_size(mesh)
        attention = sharding.shard_attention(attention, mesh)  # per KV-head shard if tp > 1
        platform = mesh.devices.flat[0].platform  # a compile-only device's too
        if abstract and (pack_matmuls or num_swap_pages):
            raise ValueError("an abstract runner takes no packed matmuls and no swap pool")
        if not abstract:  # (the CPU's packing reads the weights)
            params, infos = prepare_cpu_params(
                params,
                infos,
                pack=pack_matmuls,
                greedy_screen=greedy_screen,
                platform=platform,
                tied=spec.tie_word_embeddings,
            )
        if scan_layers:  # one array per weight per run of layers, for the scan
            params, infos = stack_layers(params, infos)
        rules = sharding.rules_for(spec, tp)
        self._replicated = sharding.replicated(mesh)
        if pack_matmuls:  # one device: packed weights are never sharded
            self.param_shardings = jax.tree_util.tree_map(lambda _: self._replicated, params)
        else:
            self.param_shardings = sharding.param_shardings(infos, mesh, rules)
        self.kv_sharding = sharding.kv_pages_sharding(mesh)
        pool = dict(num_pages=num_pages, page_size=page_size, dtype=kv_cache_dtype)
        if abstract:
            self.params = jax.tree_util.tree_map(
                lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                params,
                self.param_shardings,
            )
            self.state = abstract_state(
                spec, sharding=self.kv_sharding, stacked=scan_layers, **pool
            )
        else:
            self.params = sharding.shard_params(params, self.param_shardings)
            self.state = init_state(spec, sharding=self.kv_sharding, stacked=scan_layers, **pool)
        # (a quantized pool's scales: by KV head like their pages)
        state_shardings = sharding.kv_cache_shardings(mesh, self.state)
        # The static arguments are bound here: jit takes no keyword arguments alongside
        # in_shardings.
        logits_shardings = sharding.logits_shardings(mesh, rules)
        step = functools.partial(
            step_module.packed_step,
            spec=spec,
            attention=attention,
            num_top_logprobs=num_top_logprobs,
            logits_shardings=logits_shardings,
            scan_layers=scan_layers,
        )
        logits_sharding = logits_shardings[-1] if logits_shardings else self._replicated
        self._step = jax.jit(
            step,
            static_argnums=(5,),  # the StepInput buffers' layout
            donate_argnames=("state",),
            in_shardings=(
                self.param_shardings,
                state_shardings,
                *(self._replicated,) * 3,  # StepInput: two buffers and its large arrays
            ),
            out_shardings=(
                self._replicated,  # the greedy tokens
                self._replicated,
                logits_sharding,  # for the sampling program
                state_shardings,
                self._replicated,  # the sampled tokens for the next step (async scheduling)
            ),
        )
        self._sample = jax.jit(
            functools.partial(
                step_module.sample_step, num_top_logprobs=num_top_logprobs, platform=platform
            ),
            donate_argnums=(2,),  # the step's next-step token buffer, rewritten
            in_shardings=(logits_sharding, *(self._replicated,) * 3),
            out_shardings=self._replicated,
        )
        self.swap_pool = None
        if num_swap_pages > 0:
            self.swap_pool = HostSwapPool(
                spec,
                num_slots=num_swap_pages,
                num_pages=num_pages,
                page_size=page_size,
                pages_per_seq=pages_per_seq,
                dtype=kv_cache_dtype,
                state_shardings=state_shardings,
                write_kv=attention.write_kv,
                copy_kv=attention.copy_kv,
                mesh=mesh,
                stacked=scan_layers,
            )
        self.max_model_len = max_model_len
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self._compiled_samplers: dict[int, jax.stages.Compiled] = {}  # by sequence rows S
        self._no_penalty_tokens: dict[Bucket, tuple[jax.Array, jax.Array]] = {}
        self._all_tokens: dict[Bucket, jax.Array] = {}  # token masks allowing every id
        # The last step's sampled tokens on device, i32[num_sampled_rows] (the largest
        # bucket's S, so one shape for every bucket): a step packed before its predecessor's
        # tokens were read back takes its decode inputs from here (StepInput.prev_rows).
        self.num_sampled_rows = 0
        self._sampled: jax.Array | None = None
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
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            (self.params, self.state),
        )
        self._queue: CompileQueue | None = None  # programs compiling in the background
        self._queue_keys: dict[Bucket | int, tuple[Bucket, int | None]] = {}

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
        jobs: dict[tuple[Bucket, int | None], jax.stages.Lowered] = {}
        lower_seconds: dict[tuple[Bucket, int | None], float] = {}
        for key in keys:
            t0 = time.perf_counter()
            jobs[key] = self._trace(key).lower()
            lower_seconds[key] = time.perf_counter() - t0

        def compile_one(key: tuple[Bucket, int | None]) -> tuple:
            t0 = time.perf_counter()
            compiled = jobs[key].compile()
            return key, compiled, lower_seconds[key] + time.perf_counter() - t0

        total = 0.0
        with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
            done = pool.map(compile_one, jobs) if pool else map(compile_one, jobs)
            if progress:
                from tqdm.auto import tqdm

                done = tqdm(
                    done, total=len(jobs), desc="compiling buckets", unit="program", leave=False
                )
            for key, compiled, seconds in done:
                self._record(key, compiled, seconds, lower_seconds[key])
                total += seconds
        if later:
            self._queue_keys = {(b if s is None else s): (b, s) for b, s in later}
            self._queue = CompileQueue(list(self._queue_keys), self._compile_later)
            logger.info("compiling %d more programs in the background", len(later))
        return total

    def _trace(self, key: tuple[Bucket, int | None]) -> jax.stages.Traced:
        bucket, num_seqs = key
        return self.trace_step(bucket) if num_seqs is None else self.trace_sampler(num_seqs)

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
        t0 = time.perf_counter()
        lowered = self._trace(key).lower()
        lower_seconds = time.perf_counter() - t0
        compiled = lowered.compile()
        self._record(key, compiled, time.perf_counter() - t0, lower_seconds)
        return compiled

    def _program(self, program: Bucket | int) -> jax.stages.Compiled:
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
        return self._program(bucket)

    def compiled_sampler(self, num_seqs: int) -> jax.stages.Compiled:
        """The compiled sampling program for S sequence rows (after `compile`)."""
        return self._program(num_seqs)

    def prepare(self, sched: SchedulerOutput, bucket: Bucket) -> StepInput:
        return pack_step_input(
            sched,
            bucket,
            page_size=self.page_size,
            pages_per_seq=self.pages_per_seq,
            max_model_len=self.max_model_len,
            num_top_logprobs=self.num_top_logprobs,
            vocab_size=self.spec.vocab_size,
        )

    def execute(self, bucket: Bucket, inp: StepInput) -> StepResult:
        """Run the step and wait for its tokens."""
        return self.collect(self.dispatch(bucket, inp))

    def dispatch(self, bucket: Bucket, inp: StepInput) -> PendingStep:
        """Start the bucket's compiled step (and sampling, if the step needs it) and return
        without waiting for them: jax dispatches asynchronously while nothing reads the
        outputs (`collect` does)."""
        if self._sampled is None:
            rows = max(self.num_sampled_rows, bucket.num_seqs)
            self._sampled = jax.device_put(np.zeros(rows, np.int32), self._replicated)
        inp.prev_token_ids = self._sampled
        self._fill_sampling_defaults(bucket, inp)  # (the step's input tree has them too)
        ints, floats = pack_small(inp)
        large = tuple(getattr(inp, name) for name in LARGE_FIELDS)
        greedy_ids, prompt_out, logits, self.state, self._sampled = self._program(bucket)(
            self.params, self.state, ints, floats, large
        )  # step()
        out = None
        if step_module.needs_sampling(inp.flags):
            out, self._sampled = self._program(bucket.num_seqs)(
                logits, greedy_ids, self._sampled, sampling_input(inp)
            )  # sample_step()
        num_prompt_rows = int(inp.num_prompt_logprob_rows[0])
        return PendingStep(
            greedy_ids if out is None else out.token_ids,
            out,
            prompt_out,
            num_prompt_rows=num_prompt_rows,
            want_top=bool(inp.flags[FLAG_TOP_LOGPROBS]),
            want_prompt_top=num_prompt_rows > 0 and bool(inp.flags[FLAG_PROMPT_TOP_LOGPROBS]),
        )

    def _fill_sampling_defaults(self, bucket: Bucket, inp: StepInput) -> None:
        """Device-resident no-penalty and all-allowed rows where the packer left None."""
        if inp.penalty_tokens is None:
            if bucket not in self._no_penalty_tokens:
                arrays = no_penalties(bucket.num_seqs, self.max_model_len)
                self._no_penalty_tokens[bucket] = jax.device_put(arrays, self._replicated)
            inp.penalty_tokens, inp.penalty_counts = self._no_penalty_tokens[bucket]
        if inp.token_mask is None:
            if bucket not in self._all_tokens:
                mask = all_tokens_allowed(bucket.num_seqs, self.spec.vocab_size)
                self._all_tokens[bucket] = jax.device_put(mask, self._replicated)
            inp.token_mask = self._all_tokens[bucket]

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a dispatched step and read back what the host needs of it."""
        out, prompt_out = pending.out, pending.prompt_out
        want_top, want_prompt_top = pending.want_top, pending.want_prompt_top
        num_prompt_rows = pending.num_prompt_rows
        wanted = {
            "token_ids": pending.token_ids,
            "logprobs": out.logprobs if out is not None else None,
            "top_token_ids": out.top_token_ids if want_top else None,
            "top_logprobs": out.top_logprobs if want_top else None,
            "prompt_logprobs": prompt_out.logprobs if num_prompt_rows else None,
            "prompt_top_token_ids": prompt_out.top_token_ids if want_prompt_top else None,
            "prompt_top_logprobs": prompt_out.top_logprobs if want_prompt_top else None,
        }
        with collective("reading the step's results"):  # multi-process: a peer may be gone
            fetched = jax.device_get({k: v for k, v in wanted.items() if v is not None})
        if out is None:  # no row asked for logprobs
            fetched["logprobs"] = np.zeros(len(fetched["token_ids"]), np.float32)
        for name in ("prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs"):
            if name in fetched:  # the prompt logprob rows, without the bucket's padding
                fetched[name] = fetched[name][:num_prompt_rows]
        return StepResult(**{name: fetched.get(name) for name in wanted})

    def compile_swap(self) -> float:
        """Compile the swap copies (if there is a host swap pool); returns seconds."""
        return self.swap_pool.compile(self.state) if self.swap_pool else 0.0

    def measure_swap_bandwidth(self) -> float:
        """Device-host bytes per second, measured once at start-up (0.0: no swap pool)."""
        if self.swap_pool is None:
            return 0.0
        self.state, bytes_per_s = self.swap_pool.measure_bandwidth(self.state)
        return bytes_per_s

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Copy (page, slot) pairs out to the host, then (slot, page) pairs back in: out
        first, as a victim's pages may be handed to another request in the same step."""
        if swap_out:
            pages, slots = zip(*swap_out, strict=True)
            self.swap_pool.swap_out(self.state, pages, slots)
        if swap_in:
            slots, pages = zip(*swap_in, strict=True)
            self.state = self.swap_pool.swap_in(self.state, slots, pages)

    def check_health(self) -> None:
        leaves = jax.tree_util.tree_leaves(self.state)
        if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in leaves):
            raise RuntimeError("the device KV cache was lost in a failed step")
