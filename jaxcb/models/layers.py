"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, dense projections."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, in float32 (the result is float32)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * x32


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x @ w (+ b): inputs in the weights' dtype, float32 accumulation and result.

    bf16 inputs with an f32 accumulator is where XLA's CPU backend (and every accelerator)
    is fastest; asking for a bf16 result directly is several times slower on CPU. Keeping
    activations in f32 between matmuls also avoids bf16 elementwise ops, which the CPU
    backend emulates through conversions.
    """
    y = jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
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


def apply_rope(
    x: jax.Array,  # [T, H, D]
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D // 2]
) -> jax.Array:  # [T, H, D]
    """Rotary embedding in the "rotate half" layout used by Hugging Face checkpoints."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]  # [T, 1, D/2]
    sin = jnp.sin(freqs)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, H, D/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
