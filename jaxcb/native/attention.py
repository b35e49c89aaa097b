"""The native CPU attention kernels (attention.cc) as jax functions: ragged paged attention
over float32, bfloat16 or quantized int8 / float8 pages with their per-row scales, the
in-place KV write (the quantized one computes each row's scale and codes), and the bit-exact
copy of rows into their slots (swapped-out pages coming back). Each wrapper makes sure its
ISA level's library (the active level's, unless told another) is built and registered
(build.py) and calls its FFI target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    ATTENTION_TARGET,
    KV_WRITE_QUANT_TARGET,
    KV_WRITE_TARGET,
    active_level,
    registered_target,
)


def ragged_paged_attention_native(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    level: str | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,
    pool_layers: int = 1,  # (layers whose pages the pool holds: read by the Pallas cost only)
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention on CPU (same contract as the jnp reference), by the library of
    ISA `level` (default: the active one; tests run each level this CPU can). Pages of
    int8, float8_e4m3fn or float8_e5m2 codes come with their scales (value = code x scale,
    one scale per head, page and slot); float pages with none. q stays in its float dtype."""
    quantized = _check_scales(k_pages, k_scales, v_scales)
    if not quantized:  # the kernel reads no scales: an empty array stands for them
        k_scales = v_scales = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(
        registered_target(ATTENTION_TARGET, level or active_level()),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
    )
    return call(
        q,
        k_pages,
        v_pages,
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        k_scales,
        v_scales,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


def write_kv_native(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """In-place KV page write on CPU, for float32 and bfloat16 pools alike: (k_pages,
    v_pages). A quantized pool (int8, float8_e4m3fn, float8_e5m2) comes with its scales and
    gets each new row's codes and scale (scale = max|x| / QMAX, as kv_quant.quantize_rows):
    (k_pages, v_pages, k_scales, v_scales)."""
    if _check_scales(k_pages, k_scales, v_scales):
        call = jax.ffi.ffi_call(
            registered_target(KV_WRITE_QUANT_TARGET, active_level()),
            tuple(
                jax.ShapeDtypeStruct(x.shape, x.dtype)
                for x in (k_pages, v_pages, k_scales, v_scales)
            ),
            input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
        )
        return tuple(
            call(k_pages, v_pages, k_scales, v_scales, k, v, slot_mapping.astype(jnp.int32))
        )
    shapes = (
        jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
    )
    call = jax.ffi.ffi_call(
        registered_target(KV_WRITE_TARGET, active_level()),
        shapes,
        input_output_aliases={0: 0, 1: 1},
    )
    return call(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))


def copy_kv_native(
    k_pool: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim], or scales (no D)
    v_pool: jax.Array,
    k_rows: jax.Array,  # [T, num_kv_heads, head_dim] (or [T, num_kv_heads]), the pool's dtype
    v_rows: jax.Array,
    slot_mapping: jax.Array,  # i32[T]; out of range: written nowhere
) -> tuple[jax.Array, jax.Array]:
    """Rows of the pools' own dtype into their slots, bit for bit and in place: a quantized
    pool's codes and scales coming back from host memory (XLA's CPU backend copies a whole
    float8 pool for any scatter or dynamic_update_slice into it)."""
    call = jax.ffi.ffi_call(  # (the kernel takes 3-D scale pools as they are: a reshape
        # of a donated pool would be copied)
        registered_target(KV_WRITE_TARGET, active_level()),
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k_pool, v_pool)),
        input_output_aliases={0: 0, 1: 1},
    )
    return tuple(call(k_pool, v_pool, k_rows, v_rows, slot_mapping.astype(jnp.int32)))


#: The page dtypes the native kernels read as codes with a float32 scale per row.
QUANTIZED_KV_DTYPES = (
    jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn),
    jnp.dtype(jnp.float8_e5m2),
)


def _check_scales(
    k_pages: jax.Array, k_scales: jax.Array | None, v_scales: jax.Array | None
) -> bool:
    """Whether the pages are quantized; their scales must then be given, shaped
    [num_kv_heads, num_pages, page_size] (and float pages take none)."""
    quantized = jnp.dtype(k_pages.dtype) in QUANTIZED_KV_DTYPES
    given = k_scales is not None and v_scales is not None
    if quantized != given or (k_scales is None) != (v_scales is None):
        raise ValueError(
            f"{k_pages.dtype} K/V pages take "
            + ("their k_scales and v_scales" if quantized else "no scales")
        )
    if quantized and not (k_scales.shape == v_scales.shape == k_pages.shape[:3]):
        raise ValueError(
            f"K/V scales must be shaped {k_pages.shape[:3]} (heads, pages, slots), got "
            f"{k_scales.shape} and {v_scales.shape}"
        )
    return quantized
