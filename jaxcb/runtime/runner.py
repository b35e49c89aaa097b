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

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.engine.buckets import Bucket
from jaxcb.engine.interface import StepResult
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.lora import (
    has_lora,
    slot_layout,
    slot_values,
    stack_slot_values,
    write_slot,
)
from jaxcb.models import registry
from jaxcb.models.base import AttentionBackend, ModelSpec, Params
from jaxcb.models.cpu_params import prepare_cpu_params
from jaxcb.models.loading.peft import Adapter, read_adapter
from jaxcb.models.stacking import run_length, stack_layers
from jaxcb.runtime import sharding
from jaxcb.runtime import step as step_module
from jaxcb.runtime.distributed import collective
from jaxcb.runtime.kv_cache import abstract_state, init_state
from jaxcb.runtime.kv_swap import HostSwapPool
from jaxcb.runtime.programs import StepPrograms
from jaxcb.runtime.prompt_logprobs import PromptLogprobsOutput
from jaxcb.runtime.step_input import (
    FLAG_PROMPT_TOP_LOGPROBS,
    FLAG_TOP_LOGPROBS,
    LARGE_FIELDS,
    StepInput,
    all_tokens_allowed,
    no_penalties,
    pack_small,
    pack_step_input,
    sampling_input,
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
        allocated; such a runner only compiles (`compile`, `programs.compiled_step`) and
        cannot run a step: for a target that is not present (runtime/aot.py, on its compile-only
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
        self.programs = StepPrograms(
            spec,
            self.params,
            self.state,
            attention=attention,
            num_top_logprobs=num_top_logprobs,
            scan_layers=scan_layers,
            platform=platform,
            pages_per_seq=pages_per_seq,
            max_model_len=max_model_len,
            param_shardings=self.param_shardings,
            state_shardings=state_shardings,
            logits_shardings=sharding.logits_shardings(mesh, rules),
            replicated=self._replicated,
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
        self._no_penalty_tokens: dict[Bucket, tuple[jax.Array, jax.Array]] = {}
        self._all_tokens: dict[Bucket, jax.Array] = {}  # token masks allowing every id
        # LoRA: each added adapter's slot values on the host, stacked as the layer runs are
        # (jaxcb/lora.py), and the program that writes them into a slot.
        self._adapters: dict[int, list[Params]] = {}
        self._write_lora = None
        if has_lora(self.params):
            if not scan_layers:
                raise ValueError("LoRA adapters need the layers scanned (kernels.scan_layers true)")
            lora_shardings = [run["lora"] for run in self.param_shardings["layers"]]
            self._write_lora = jax.jit(
                lambda loras, values, index: [
                    write_slot(lora, v, index) for lora, v in zip(loras, values, strict=True)
                ],
                donate_argnums=0,
                out_shardings=lora_shardings,
            )
            if not abstract:  # compiled now, not when an adapter first loads mid-serving:
                # slot 1 written with what it holds (an adapter of no pairs: zeros)
                self._write_slot(1, self._stacked_slot_values(Adapter(Path(), 0, {})))
        # The last step's sampled tokens on device, i32[programs.num_sampled_rows] (the
        # largest bucket's S, so one shape for every bucket): a step packed before its
        # predecessor's tokens were read back takes its decode inputs from here
        # (StepInput.prev_rows).
        self._sampled: jax.Array | None = None

    # ---- LoRA adapters (engine/lora_slots.py decides the slots) --------------------------

    def read_lora(self, path: str) -> list[Params]:
        """A PEFT adapter's slot values on the host, stacked as the layer runs are (host
        work only: safe on any thread, so a server reads it off the engine's)."""
        if self._write_lora is None:
            raise ValueError("LoRA is off: start the engine with enable_lora=True")
        return self._stacked_slot_values(read_adapter(path))

    def _stacked_slot_values(self, adapter: Adapter) -> list[Params]:
        _, max_rank, dtype = slot_layout(self.params)
        values = slot_values(adapter, self.spec, registry.param_infos(self.spec), max_rank, dtype)
        return stack_slot_values(values, [run_length(stack) for stack in self.params["layers"]])

    def add_lora(self, lora_id: int, path: str, values: Any = None) -> None:
        """Keep an adapter's slot values as `lora_id`: `values` from `read_lora`, else read
        from `path` now (engine/interface.py's Runner)."""
        if lora_id not in self._adapters:
            self._adapters[lora_id] = self.read_lora(path) if values is None else values

    def remove_lora(self, lora_id: int) -> None:
        self._adapters.pop(lora_id, None)

    def load_lora_slot(self, slot: int, lora_id: int) -> None:
        """Write an added adapter into device slot `slot` (1..max_loras): an update of the
        slot arrays in place, ordered before the next step (no shape changes: no compile)."""
        self._write_slot(slot, self._adapters[lora_id])

    def _write_slot(self, slot: int, values: list[Params]) -> None:
        layers = self.params["layers"]
        loras = self._write_lora([run["lora"] for run in layers], values, slot - 1)
        self.params = {
            **self.params,
            "layers": [{**run, "lora": lora} for run, lora in zip(layers, loras, strict=True)],
        }

    def compile(self, buckets: tuple[Bucket, ...], **options: Any) -> float:
        """Compile the step of every bucket and its sampling programs (StepPrograms.compile:
        progress, threads, ready_after); returns the seconds."""
        return self.programs.compile(buckets, **options)

    def background_compile(self) -> tuple[int, float]:
        return self.programs.background_compile()

    def close(self) -> None:
        self.programs.close()

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
            rows = max(self.programs.num_sampled_rows, bucket.num_seqs)
            self._sampled = jax.device_put(np.zeros(rows, np.int32), self._replicated)
        inp.prev_token_ids = self._sampled
        self._fill_sampling_defaults(bucket, inp)  # (the step's input tree has them too)
        ints, floats = pack_small(inp)
        large = tuple(getattr(inp, name) for name in LARGE_FIELDS)
        greedy_ids, prompt_out, logits, self.state, self._sampled = self.programs.program(bucket)(
            self.params, self.state, ints, floats, large
        )  # step()
        out = None
        if step_module.needs_sampling(inp.flags):
            out, self._sampled = self.programs.program(bucket.num_seqs)(
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
