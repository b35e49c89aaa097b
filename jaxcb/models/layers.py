"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, dense projections.

Rotary embeddings (`rope_for`): default, linear, Llama 3 and LongRoPE (Phi-3) scaling. LongRoPE
rescales each frequency by a short factor for positions under the pretraining length
(original_max_position_embeddings) and by a long factor from there on, and multiplies cos and
sin by an attention factor. jaxcb picks the factors per token, by its own position: a key's
rotation depends only on its position, so the KV cache is the same however a sequence is
chunked, batched or prefix-cached. transformers picks one set for a whole forward call, long
when the call reaches the pretraining length (so keys cached by earlier calls keep the short
factors): that depends on how the calls chunk the sequence, which continuous batching with
chunked prefill cannot reproduce. The two agree wherever a sequence stays under the
pretraining length; past it they differ for the keys transformers cached while under it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if TYPE_CHECKING:
    from jaxcb.models.base import ModelSpec


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, in float32 (the result is float32)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * x32


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): values squashed smoothly into (-cap, cap) (Gemma 2's logits)."""
    return cap * jnp.tanh(x / cap)


def precision(dtype: Any) -> lax.Precision | None:
    """HIGHEST for float32 operands (full float32 products on every backend, as torch's
    default; XLA's DEFAULT is TF32 on NVIDIA GPUs and bf16 passes on TPU), else the default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x @ w (+ b): inputs in the weights' dtype, float32 accumulation and result.

    bf16 inputs with an f32 accumulator is where XLA's CPU backend (and every accelerator)
    is fastest; asking for a bf16 result directly is several times slower on CPU. Keeping
    activations in f32 between matmuls also avoids bf16 elementwise ops, which the CPU
    backend emulates through conversions.

    float32 weights multiply in full float32 (`precision(w.dtype)`): GPUs would otherwise
    round the inputs to TF32, and greedy tokens drift from a float32 reference.
    """
    y = jnp.dot(
        x.astype(w.dtype), w, preferred_element_type=jnp.float32, precision=precision(w.dtype)
    )
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> np.ndarray:
    """Inverse frequencies for rotary embeddings, with Llama 3 / linear scaling.

    Computed once on the host in float64 and rounded to float32, as the reference does in
    float32; the difference is far below float32 resolution of the final angles.
    """
    inv_freq = (1.0 / _rope_bases(head_dim, rope_theta)).astype(np.float32)
    rope_type = _rope_type(rope_scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / np.float32(rope_scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, "
        "longrope (through rope_for)"
    )


def _rope_bases(head_dim: int, rope_theta: float) -> np.ndarray:
    """theta ** (2i / D) for each rotated pair i, in float32 as the reference computes it."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    return (rope_theta**exponents).astype(np.float32)


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    scaling = rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def longrope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, float]:
    """LongRoPE's (short inv_freq, long inv_freq, attention factor).

    Each frequency is divided by its factor (short_factor / long_factor, one per rotated
    pair). The attention factor scales cos and sin: the config's `attention_factor`, else
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) when the context was
    extended (factor > 1), else 1. `factor` is the config's, else max_position_embeddings /
    original_max_position_embeddings, which the config mapping (llama.rope_from_config) fills in.
    """
    bases = _rope_bases(head_dim, rope_theta)
    short, long = (np.asarray(rope_scaling[k], np.float32) for k in ("short_factor", "long_factor"))
    if short.shape != bases.shape or long.shape != bases.shape:
        raise ValueError(
            f"longrope short_factor and long_factor need {bases.size} values (head_dim / 2), "
            f"got {short.size} and {long.size}"
        )
    short, long = ((1.0 / (factors * bases)).astype(np.float32) for factors in (short, long))
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(rope_scaling["factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
        extended = factor > 1
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if extended else 1
    return short, long, float(attention_factor)


def rope_for(spec: ModelSpec, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rotary tables (`rope_tables`) of `spec`'s rope at each position (i32[T]).

    LongRoPE chooses its frequencies per token: short factors below
    original_max_position_embeddings, long ones from there on (the module docstring says
    why per token and how that differs from transformers)."""
    scaling = dict(spec.rope_scaling) if spec.rope_scaling else None
    if _rope_type(scaling) != "longrope":
        inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, scaling)
        return rope_tables(positions, jnp.asarray(inv_freq))
    short, long, attention_factor = longrope_inv_freq(spec.head_dim, spec.rope_theta, scaling)
    is_long = positions >= scaling["original_max_position_embeddings"]
    inv_freq = jnp.where(is_long[:, None], jnp.asarray(long), jnp.asarray(short))  # [T, D/2]
    return rope_tables(positions, inv_freq, attention_factor)


def rope_tables(
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D // 2], or f32[T, D // 2]: each token's own
    attention_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:  # f32[T, 1, D] each
    """cos and signed sin of every position (both times `attention_factor`, LongRoPE's), for
    `apply_rope`; computed once per step and shared by all layers."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, D/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return (
        jnp.concatenate([cos, cos], axis=-1)[:, None, :],
        jnp.concatenate([-sin, sin], axis=-1)[:, None, :],
    )


def apply_rope(
    x: jax.Array,  # [T, H, D]
    tables: tuple[jax.Array, jax.Array],  # from rope_tables
) -> jax.Array:  # [T, H, D]
    """Rotary embedding in the "rotate half" layout used by Hugging Face checkpoints:
    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]. The halves are swapped with a reverse
    over an axis of two, not split and concatenated: XLA's CPU backend fuses the former
    into one vectorized loop and the latter into a slow one."""
    cos, sin = tables
    t, h, d = x.shape
    x32 = x.astype(jnp.float32)
    swapped = jnp.flip(x32.reshape(t, h, 2, d // 2), axis=2).reshape(t, h, d)  # [x2, x1]
    return (x32 * cos + swapped * sin).astype(x.dtype)
