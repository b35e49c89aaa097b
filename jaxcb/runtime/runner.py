"""ModelRunner: owns params and device state, compiles every bucket ahead of time, runs steps.

The runner works on a mesh (runtime/sharding.py): one device, or `tensor_parallel_size`
devices over which the params and the KV pages are sharded. The step is jitted with explicit
in/out shardings (params as the rules say, KV pages by KV head, step inputs and sampled
tokens replicated), so the same buckets compile into one SPMD program per bucket.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.engine.buckets import Bucket
from jaxcb.models.llama import AttentionBackend, ModelSpec, Params
from jaxcb.runtime import sharding
from jaxcb.runtime import step as step_module
from jaxcb.runtime.kv_cache import init_state
from jaxcb.runtime.step_input import FLAG_TOP_LOGPROBS, StepInput, empty_step_input

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What the host needs back from one step (numpy, sequence rows)."""

    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray  # f32[S]
    top_token_ids: np.ndarray | None  # i32[S, K] when any row asked for top logprobs
    top_logprobs: np.ndarray | None  # f32[S, K]


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        params: Params,
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
    ) -> None:
        """`pack_matmuls`: a native matmul kernel ("amx", "avx512_bf16", "avx512") to run
        the matmuls of its dtype on, their weights packed for it (CPU, one device; see
        `matmul_backend`). `greedy_screen`: with "avx512", also keep the bf16 screen of the
        float32 lm_head that finds greedy tokens at bf16 cost (if this CPU has AVX512-BF16)."""
        self.spec = spec
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.num_top_logprobs = num_top_logprobs
        self.mesh = mesh = mesh if mesh is not None else sharding.replica_mesh(1)
        tp = sharding.tensor_parallel_size(mesh)
        attention = sharding.shard_attention(attention, mesh)  # per KV-head shard if tp > 1
        params = _adapt_params_for_backend(params)
        if pack_matmuls:
            params = _pack_matmul_weights(params, pack_matmuls, greedy_screen=greedy_screen)
        rules = sharding.rules_for(spec, tp)
        self.param_shardings = sharding.param_shardings(params, mesh, rules)
        self.params = sharding.shard_params(params, self.param_shardings)
        self.kv_sharding = sharding.kv_pages_sharding(mesh)
        self.state = init_state(
            spec,
            num_pages=num_pages,
            page_size=page_size,
            dtype=kv_cache_dtype,
            sharding=self.kv_sharding,
        )
        self._replicated = sharding.replicated(mesh)
        state_shardings = jax.tree_util.tree_map(lambda _: self.kv_sharding, self.state)
        # The static arguments are bound here: jit takes no keyword arguments alongside
        # in_shardings.
        step = functools.partial(
            step_module.step,
            spec=spec,
            attention=attention,
            num_top_logprobs=num_top_logprobs,
            logits_shardings=sharding.logits_shardings(mesh, rules),
        )
        self._step = jax.jit(
            step,
            donate_argnames=("state",),
            in_shardings=(self.param_shardings, state_shardings, self._replicated),
            out_shardings=(self._replicated, self._replicated, state_shardings),
        )
        self.max_model_len = max_model_len
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self._no_penalty_tokens: dict[Bucket, jax.Array] = {}
        self.compile_seconds: dict[int, float] = {}

    def compile(self, buckets: tuple[Bucket, ...], progress: bool = False) -> float:
        """AOT-compile the step for every bucket; returns total seconds."""
        items = buckets
        if progress:
            from tqdm.auto import tqdm

            items = tqdm(buckets, desc="compiling buckets", unit="bucket", leave=False)
        total = 0.0
        for bucket in items:
            t0 = time.perf_counter()
            example = empty_step_input(bucket, self.pages_per_seq, self.max_model_len)
            lowered = self._step.lower(self.params, self.state, example)
            self._compiled[bucket] = lowered.compile()
            seconds = time.perf_counter() - t0
            # per token bucket (its sequence-row variants summed)
            t = bucket.num_tokens
            self.compile_seconds[t] = self.compile_seconds.get(t, 0.0) + seconds
            total += seconds
            logger.info(
                "compiled bucket T=%d S=%d in %.2fs", bucket.num_tokens, bucket.num_seqs, seconds
            )
        return total

    def execute(self, bucket: Bucket, inp: StepInput) -> StepResult:
        compiled = self._compiled[bucket]
        if inp.penalty_tokens is None:
            if bucket not in self._no_penalty_tokens:
                shape = (bucket.num_seqs, self.max_model_len)
                self._no_penalty_tokens[bucket] = jax.device_put(
                    np.zeros(shape, np.int32), self._replicated
                )
            inp.penalty_tokens = self._no_penalty_tokens[bucket]
        out, _logits, self.state = compiled(self.params, self.state, inp)  # see step()
        want_top = bool(inp.flags[FLAG_TOP_LOGPROBS])
        fetched = jax.device_get(
            (out.token_ids, out.logprobs)
            + ((out.top_token_ids, out.top_logprobs) if want_top else ())
        )
        return StepResult(
            token_ids=fetched[0],
            logprobs=fetched[1],
            top_token_ids=fetched[2] if want_top else None,
            top_logprobs=fetched[3] if want_top else None,
        )


def _adapt_params_for_backend(params: Params) -> Params:
    """Store a bfloat16 embedding table as raw uint16 bits on CPU.

    XLA's CPU backend has no bfloat16 gather: looking up a few rows converted the whole
    table to float32 in every step (23 ms for 32000 x 512). Gathering uint16 rows and
    viewing them as bfloat16 costs nothing. Tied embeddings keep a bf16 copy as lm_head.
    """
    embed = params["embed"]
    if jax.default_backend() != "cpu" or embed.dtype != jnp.bfloat16:
        return params
    # Arrays restored from an orbax checkpoint are on the (CPU) devices: read them back.
    params = dict(params)
    if "lm_head" not in params:
        params["lm_head"] = np.ascontiguousarray(np.asarray(embed).T)
    params["embed"] = np.asarray(embed).view(np.uint16)
    return params


#: The matmul weights of a layer, and how each is viewed as [in, out] before packing.
_MATMUL_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def matmul_backend(name: str, *, dtype: jnp.dtype, tensor_parallel_size: int) -> str:
    """The matmul path for `kernels.matmul` = name: one of jaxcb's native CPU kernels over
    packed weights ("amx" or "avx512_bf16" for bfloat16 weights on a CPU with AMX or with
    AVX512-BF16, "avx512" for float32 weights on a CPU with AVX-512; one device per replica)
    or "xla". "auto" picks the first native kernel that can run, else xla; a native kernel
    named where it cannot run is a ValueError saying why."""
    from jaxcb import native

    def reasons(kernel: str) -> list[str]:
        spec = native.PACKED_MATMULS[kernel]
        found = []
        if jax.default_backend() != "cpu":
            found.append(f"the platform is {jax.default_backend()}, not cpu")
        if jnp.dtype(dtype) != jnp.dtype(spec.dtype):
            want = jnp.dtype(spec.dtype).name
            found.append(f"the weights are {jnp.dtype(dtype).name}, not {want}")
        if tensor_parallel_size > 1:
            found.append("tensor parallelism shards the weights (the kernel is per device)")
        if not found and not spec.available():
            found.append(f"this CPU, compiler or OS gives no {spec.isa}")
        return found

    if name == "auto":
        return next((k for k in native.PACKED_MATMULS if not reasons(k)), "xla")
    if name == "xla":
        return name
    if why := reasons(name):
        raise ValueError(f"kernels.matmul={name!r} cannot run: " + "; ".join(why))
    return name


def _pack_matmul_weights(params: Params, kernel: str, *, greedy_screen: bool) -> Params:
    """Each matmul weight of the kernel's dtype whose [in, out] view fits its packed layout
    becomes {kernel: packed} (models/llama.py sends those to that native kernel); a float32
    lm_head packed for "avx512" gains its bf16 screen (`greedy_screen`, where it can run)."""
    from jaxcb import native

    spec = native.PACKED_MATMULS[kernel]

    def pack(w: object) -> object:
        w2 = np.asarray(w)
        w2 = w2.reshape(w2.shape[0], -1)
        if w2.dtype != jnp.dtype(spec.dtype) or not spec.can_pack(w2.shape):
            return w
        return {kernel: spec.pack(w2)}

    params = dict(params)
    params["layers"] = [
        {k: pack(v) if k in _MATMUL_WEIGHTS else v for k, v in layer.items()}
        for layer in params["layers"]
    ]
    if "lm_head" in params:
        lm_head = np.asarray(params["lm_head"])
        params["lm_head"] = pack(lm_head)
        if (
            greedy_screen
            and kernel == "avx512"
            and isinstance(params["lm_head"], dict)
            and native.can_pack_bf16(lm_head.shape)
            and native.argmax_screen_available()
        ):
            params["lm_head_screen"] = native.pack_argmax_screen(lm_head)
    return params
