"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, dense projections."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, in float32 (the result is float32)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * x32


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
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (rope_theta**exponents)).astype(np.float32)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
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
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def rope_tables(
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D // 2]
) -> tuple[jax.Array, jax.Array]:  # f32[T, 1, D] each
    """cos and signed sin of every position, for `apply_rope`; computed once per step and
    shared by all layers."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
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
