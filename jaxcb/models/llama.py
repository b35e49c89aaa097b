"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

The forward pass takes a packed, ragged batch of tokens (prefill chunks and decode tokens of
many requests on one axis), writes each layer's new K/V into the page pool, runs ragged paged
attention, and returns logits only at the rows that are sampled.

Parameter pytree (plain dicts and lists; projections stored as [in, out]):

    embed        [V, H]
    layers[i]    attn_norm [H]; wqkv [H, Hkv, G + 2, D] (per KV head: its G query heads,
                 then K, then V); bqkv [Hkv, G + 2, D] (Qwen2); q_norm, k_norm [D] (Qwen3);
                 wo [Hq * D, H]; mlp_norm [H]; w_gate_up [H, 2, I]; w_down [I, H]
    final_norm   [H]
    lm_head      [H, V]   (absent when the embeddings are tied)
    lm_head_screen        (optional, CPU) a bf16 copy of a float32 lm_head and its column
                 statistics, for exact greedy tokens at bf16 cost (native.pack_argmax_screen)

Grouping q/k/v per KV head makes one matmul for all three and lets tensor parallelism shard
the KV-head axis without splitting a group.

On CPUs the runner may replace the matmul weights (wqkv, wo, w_gate_up, w_down, lm_head,
each viewed as [in, out]) by {kernel: packed} (jaxcb.native.PACKED_MATMULS: "amx" or
"avx512_bf16" for bfloat16, "avx512" for float32); `matmul` sends those to that kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.models.layers import apply_rope, dense, rms_norm, rope_inv_freq, rope_tables
from pallas_kernels.ragged_paged_attention import write_kv

Params = dict[str, Any]
KVCache = list[tuple[jax.Array, jax.Array]]  # per layer (k_pages, v_pages)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the forward pass needs; hashable so it can be static in jit."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def inv_freq(self) -> jax.Array:
        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        return jnp.asarray(rope_inv_freq(self.head_dim, self.rope_theta, scaling))

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        per_layer = (
            h * (self.num_q_heads + 2 * self.num_kv_heads) * d
            + self.num_q_heads * d * h
            + 3 * h * i
            + 2 * h
        )
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


@dataclass(frozen=True)
class AttentionMetadata:
    """What ragged paged attention needs besides q and the pages (all from StepInput)."""

    kv_lens: jax.Array  # i32[S]
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    slot_mapping: jax.Array  # i32[T]


def abstract_params(spec: ModelSpec, dtype: Any) -> Params:
    """The params pytree of `spec` as ShapeDtypeStructs (the layout in the module docstring):
    what a checkpoint must hold, and the target of a restore."""
    h, d, i, v = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.vocab_size
    hq, hkv, g = spec.num_q_heads, spec.num_kv_heads, spec.group_size

    def shape(*dims: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, jnp.dtype(dtype))

    layers = []
    for _ in range(spec.num_layers):
        layer = {
            "attn_norm": shape(h),
            "wqkv": shape(h, hkv, g + 2, d),
            "wo": shape(hq * d, h),
            "mlp_norm": shape(h),
            "w_gate_up": shape(h, 2, i),
            "w_down": shape(i, h),
        }
        if spec.qkv_bias:
            layer["bqkv"] = shape(hkv, g + 2, d)
        if spec.qk_norm:
            layer["q_norm"] = shape(d)
            layer["k_norm"] = shape(d)
        layers.append(layer)
    params: Params = {"embed": shape(v, h), "layers": layers, "final_norm": shape(h)}
    if not spec.tie_word_embeddings:
        params["lm_head"] = shape(h, v)
    return params


AttentionFn = Callable[..., jax.Array]


def matmul(
    x: jax.Array, w: jax.Array | dict[str, jax.Array], rows: jax.Array | None = None
) -> jax.Array:
    """x @ w for a [in, out] weight (float32 result), or a weight packed for a native
    kernel ({"amx" | "avx512_bf16" | "avx512": packed}). `rows` (i32 scalar): how many
    leading rows of x are real, the rest a bucket's padding; the native kernels skip the
    padding and return zeros there, other paths compute it."""
    if isinstance(w, dict):
        from jaxcb import native

        ((kernel, packed),) = w.items()
        return native.PACKED_MATMULS[kernel].kernel(x, packed, rows)
    return dense(x, w.reshape(w.shape[0], -1))


def matmul_and_argmax(
    x: jax.Array, w: jax.Array | dict[str, jax.Array], rows: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """`matmul(x, w, rows)` and, when the weight's native kernel takes it from its
    accumulators on the way out, the argmax of each result row (i32, first index on ties);
    else None."""
    if isinstance(w, dict):
        from jaxcb import native

        ((kernel, packed),) = w.items()
        argmax = native.PACKED_MATMULS[kernel].argmax
        if argmax is not None:
            return argmax(x, packed, rows)
    return matmul(x, w, rows), None


def packed_swiglu(w: jax.Array | dict[str, jax.Array]) -> Callable[..., jax.Array] | None:
    """For a gate_up weight packed for a native kernel that fuses silu(gate) * up into its
    epilogue: that fused kernel (x, packed) -> act; else None."""
    if not isinstance(w, dict):
        return None
    from jaxcb import native

    ((kernel, packed),) = w.items()
    return native.PACKED_MATMULS[kernel].swiglu if packed.shape[0] % 2 == 0 else None


@dataclass(frozen=True)
class AttentionBackend:
    """How a layer stores new K/V into the page pool and attends over it.

    `attend` has the kernel-shaped signature of `ragged_paged_attention_reference`;
    `write_kv` that of `pallas_kernels.ragged_paged_attention.write_kv`.
    """

    name: str
    attend: AttentionFn
    write_kv: Callable[..., tuple[jax.Array, jax.Array]] = write_kv


def forward(
    params: Params,
    kv_caches: KVCache,
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    logits_indices: jax.Array,  # i32[S]: rows whose next token is sampled
    meta: AttentionMetadata,
    *,
    spec: ModelSpec,
    attention: AttentionBackend,
    num_compute_tokens: jax.Array,  # i32[1]
    need_logits: jax.Array,  # bool[]: whether anything but the greedy tokens is read
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """One forward pass over a packed ragged batch: f32[S, V] logits, their greedy tokens
    (i32[S]) when the LM head's kernel computes them on the way (else None), new caches.

    The native matmuls compute only the first `num_compute_tokens` token rows (the real ones,
    plus a batching baseline's padding, which is charged that way) and the first num_seqs
    sampled rows; the rest of the bucket is padding and comes out zero.

    With an `lm_head_screen` and `need_logits` false, the greedy tokens are exact but the
    logits only their bf16 screen (see native.matmul_argmax_screened_f32)."""
    num_tokens = input_ids.shape[0]
    g, d = spec.group_size, spec.head_dim
    # Rows of the token axis and of the sampled rows that count: the rest is the bucket's
    # padding, which the native matmuls skip (a 150-token step in a 192 bucket, 5 sequences
    # of a prefill step in 128 LM-head rows).
    real_tokens = num_compute_tokens[0]
    real_seqs = meta.num_seqs[0]
    rope = rope_tables(positions, spec.inv_freq())
    x = params["embed"][input_ids]  # [T, H]
    if x.dtype == jnp.uint16:  # a bf16 table kept as raw bits (see ModelRunner): view rows
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    # The residual stream stays float32 whatever the weights' dtype; only matmul inputs and
    # the KV pages take the narrow dtype.
    x = x.astype(jnp.float32)
    new_caches: KVCache = []
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["attn_norm"], spec.rms_norm_eps)
        qkv = matmul(h, layer["wqkv"], real_tokens)  # [H, Hkv, G + 2, D] -> [T, Hkv * (G + 2) * D]
        qkv = qkv.reshape(num_tokens, spec.num_kv_heads, g + 2, d)  # [T, Hkv, G + 2, D]
        if "bqkv" in layer:
            qkv = qkv + layer["bqkv"].astype(jnp.float32)
        q = qkv[:, :, :g].reshape(num_tokens, spec.num_q_heads, d)  # [T, Hq, D]
        k = qkv[:, :, g]  # [T, Hkv, D]
        v = qkv[:, :, g + 1]  # [T, Hkv, D]
        if spec.qk_norm:
            q = rms_norm(q, layer["q_norm"], spec.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], spec.rms_norm_eps)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)

        k_pages, v_pages = attention.write_kv(*kv_caches[i], k, v, meta.slot_mapping)
        new_caches.append((k_pages, v_pages))
        attn = attention.attend(
            q.astype(k_pages.dtype),
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.page_indices,
            meta.cu_q_lens,
            meta.num_seqs,
            sm_scale=spec.sm_scale,
            sliding_window=spec.sliding_windows[i],
        )  # [T, Hq, D]
        x = x + matmul(attn.reshape(num_tokens, -1), layer["wo"], real_tokens)

        h = rms_norm(x, layer["mlp_norm"], spec.rms_norm_eps)
        w = layer["w_gate_up"]  # [H, 2, I]
        swiglu = packed_swiglu(w)
        if swiglu is not None:  # the activation in the matmul's epilogue
            act = swiglu(h, *w.values(), real_tokens)
        else:
            if isinstance(w, dict):  # packed as [H, 2 * I]
                gate_up = matmul(h, w, real_tokens).reshape(num_tokens, 2, -1)
            else:
                # Gate and up in one matmul, without merging (2, I) into one axis: tensor
                # parallelism shards I, and a merged 2 * I axis would not be sharded evenly
                # (XLA would gather w).
                gate_up = jnp.einsum(
                    "th,hci->tci", h.astype(w.dtype), w, preferred_element_type=jnp.float32
                )  # [T, 2, I]
            act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        x = x + matmul(act, layer["w_down"], real_tokens)

    last = rms_norm(x[logits_indices], params["final_norm"], spec.rms_norm_eps)  # [S, H]
    lm_head = params["lm_head"] if "lm_head" in params else params["embed"].T

    def exact(h: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        return matmul_and_argmax(h, lm_head, real_seqs)  # f32[S, V], i32[S] | None

    if "lm_head_screen" not in params:
        return *exact(last), new_caches

    from jaxcb import native

    def screened(h: jax.Array) -> tuple[jax.Array, jax.Array]:  # the same tokens
        return native.matmul_argmax_screened_f32(
            h, lm_head["avx512"], params["lm_head_screen"], real_seqs
        )

    logits, greedy = jax.lax.cond(need_logits, exact, screened, last)
    return logits, greedy, new_caches
