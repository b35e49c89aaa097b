"""Quantized KV pages: int8 / fp8 values with a float32 scale per (KV head, page, slot).

A quantized pool keeps, next to each K (or V) page array of shape
`[num_kv_heads, num_pages, page_size, head_dim]` and dtype int8, float8_e4m3fn or
float8_e5m2, a scale array `[num_kv_heads, num_pages, page_size]` (float32): the stored row
stands for `page.astype(float32) * scale[..., None]`.

A token-head row `x` (head_dim values) is quantized with one scale:

    scale  = max|x| / QMAX[dtype]        (1 where max|x| == 0, so zeros stay zeros)
    int8:    clip(round(x / scale), -127, 127)        (jnp.round: half to even)
    fp8:     (x / scale).astype(dtype)                (round to nearest even)

so the largest magnitude of every row lands on QMAX exactly. The int8 round trip is off by
at most scale / 2 per value; fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: a relative error
of at most 2**-4 or 2**-3 for values in the normal range (smaller ones are subnormal, off by
at most half the smallest subnormal step times the scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: Largest stored magnitude per quantized dtype (int8 is kept symmetric: -128 is unused).
QMAX: dict[jnp.dtype, float] = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.float8_e5m2): 57344.0,
}

#: The `kv_cache_dtype` names of the quantized dtypes.
QUANTIZED_KV_DTYPES: dict[str, jnp.dtype] = {
    "int8": jnp.dtype(jnp.int8),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}


def is_quantized_kv(dtype) -> bool:
    """Whether KV pages of `dtype` are quantized (carry scales): int8, fp8 e4m3fn or e5m2."""
    try:
        return jnp.dtype(dtype) in QMAX
    except TypeError:
        return False


def _qmax(dtype) -> float:
    dtype = jnp.dtype(dtype)
    if dtype not in QMAX:
        names = ", ".join(str(d) for d in QMAX)
        raise ValueError(f"KV pages of dtype {dtype} are not quantized: expected one of {names}")
    return QMAX[dtype]


def quantize_rows(
    x: jax.Array,  # [..., head_dim], any float dtype
    dtype,  # int8, float8_e4m3fn or float8_e5m2
) -> tuple[jax.Array, jax.Array]:  # (values [..., head_dim] of dtype, f32 scales [...])
    """Quantize each row of the last axis with its own scale (see the module docstring)."""
    qmax = _qmax(dtype)
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [...]
    # True divisions, as written (and as numpy or C++ compute them): XLA's simplifier turns
    # `a / broadcast(b)` into `a * broadcast(1 / b)`, 1 ulp off for about 5% of the values;
    # dividing by a full-shaped barrier output keeps the division.
    qmax_full = lax.optimization_barrier(jnp.full(amax.shape, qmax, jnp.float32))
    scale = jnp.where(amax == 0, jnp.float32(1), amax / qmax_full)
    y = x / lax.optimization_barrier(jnp.broadcast_to(scale[..., None], x.shape))
    if dtype == jnp.int8:
        values = jnp.clip(jnp.round(y), -qmax, qmax).astype(jnp.int8)
    else:
        # |y| <= qmax up to one f32 rounding, which the cast rounds back to qmax; the clip
        # only guards that (no fp8 overflow to NaN/inf), it never moves a value.
        values = jnp.clip(y, -qmax, qmax).astype(dtype)
    return values, scale


def dequantize(
    values: jax.Array,  # [..., head_dim] int8 / fp8
    scales: jax.Array,  # f32[...]
    dtype=jnp.float32,
) -> jax.Array:  # [..., head_dim] of dtype
    """`values.astype(f32) * scales[..., None]`, in `dtype`."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def check_scales(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,
    k_scales: jax.Array | None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None,
) -> bool:
    """Static checks of a (possibly) quantized pool; returns whether it is quantized.

    Quantized pages need both scale arrays, float32, shaped like the pages less head_dim;
    float pages take none. Raises ValueError naming the mismatch."""
    quantized = is_quantized_kv(k_pages.dtype)
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (or neither)")
    if not quantized:
        if k_scales is not None:
            raise ValueError(
                f"k_scales/v_scales are for quantized pages (int8, fp8); got {k_pages.dtype=}"
            )
        return False
    if k_scales is None:
        raise ValueError(f"{k_pages.dtype} pages need k_scales and v_scales (f32 per slot)")
    expected = tuple(k_pages.shape[:3])
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(scales.shape) != expected or scales.dtype != jnp.float32:
            raise ValueError(
                f"{name} must be float32{list(expected)} ([num_kv_heads, num_pages, page_size]),"
                f" got {scales.dtype}{list(scales.shape)}"
            )
    return True
