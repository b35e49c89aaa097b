"""The native CPU kernels as jax functions: ragged paged attention, the in-place KV write,
and matmuls over weights packed once at load time: bfloat16 on AMX tiles (CPUs with AMX) or
with AVX512-BF16 dot products (vdpbf16ps: AMD Zen 4 and later, Intel Cooper Lake and later),
and float32 with AVX-512 FMAs, whose LM head can also find greedy tokens through a bf16
screen. Each wrapper makes sure the library is built and registered (build.py) and calls its
FFI target; `PACKED_MATMULS` is the table of packed matmul kernels the model code dispatches
to (jaxcb/models/packed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    ATTENTION_TARGET,
    KV_WRITE_TARGET,
    MATMUL_AMX_TARGET,
    MATMUL_ARGMAX_AVX512_BF16_TARGET,
    MATMUL_ARGMAX_AVX512_F32_TARGET,
    MATMUL_ARGMAX_SCREENED_F32_TARGET,
    MATMUL_AVX512_BF16_TARGET,
    MATMUL_AVX512_F32_TARGET,
    SWIGLU_AVX512_BF16_TARGET,
    SWIGLU_AVX512_F32_TARGET,
    amx_available,
    avx512_available,
    avx512_bf16_available,
    load,
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
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention on CPU (same contract as the jnp reference)."""
    load()
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
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
) -> tuple[jax.Array, jax.Array]:
    """In-place KV page write on CPU, for float32 and bfloat16 pools alike."""
    load()
    shapes = (
        jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
    )
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, shapes, input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))


def can_pack_bf16(shape: tuple[int, ...]) -> bool:
    """Whether a [K, N] weight fits the packed layout: K a multiple of 32, N of 16."""
    return len(shape) == 2 and shape[0] % 32 == 0 and shape[1] % 16 == 0


def pack_bf16(w: np.ndarray) -> np.ndarray:
    """A [K, N] bfloat16 weight in the packed layout both matmul kernels read (the AMX
    B-operand layout), [N/16, K/32, 16, 32]: block (n, k) holds rows 32k .. 32k+31 and columns
    16n .. 16n+15 as 16 rows of 16 (even row, odd row) pairs, one 1 KiB tile; blocks of a
    column run contiguous along K, so k-pair p of a column block is the 64 bytes at p * 32."""
    k, n = w.shape
    if not can_pack_bf16(w.shape):
        raise ValueError(f"cannot pack a [{k}, {n}] weight: K must divide by 32 and N by 16")
    blocks = np.asarray(w).reshape(k // 32, 16, 2, n // 16, 16)  # [kb, r, parity, nb, c]
    return np.ascontiguousarray(blocks.transpose(3, 0, 1, 4, 2)).reshape(n // 16, k // 32, 16, 32)


def can_pack_f32(shape: tuple[int, ...]) -> bool:
    """Whether a [K, N] weight fits `pack_f32`: N a multiple of 16."""
    return len(shape) == 2 and shape[1] % 16 == 0


def pack_f32(w: np.ndarray) -> np.ndarray:
    """A [K, N] float32 weight as [N/16, K, 16]: 16-column blocks, each contiguous along K
    (row k of a block is one 64-byte vector)."""
    k, n = w.shape
    if not can_pack_f32(w.shape):
        raise ValueError(f"cannot pack a [{k}, {n}] weight: N must divide by 16")
    return np.ascontiguousarray(np.asarray(w).reshape(k, n // 16, 16).transpose(1, 0, 2))


def _real_rows(x: jax.Array, rows: jax.Array | int | None) -> jax.Array:
    """i32[1]: how many leading rows of x are real (all of them if None); the AVX-512
    kernels compute only those and write zeros to the rest (a bucket's padding)."""
    if rows is None:
        return jnp.full((1,), x.shape[0], jnp.int32)
    return jnp.reshape(jnp.asarray(rows, jnp.int32), (1,))


def _packed_matmul(target: str, x: jax.Array, w_packed: jax.Array, *extra: jax.Array) -> jax.Array:
    load()
    n = w_packed.shape[0] * 16
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(w_packed.dtype), w_packed, *extra)


def matmul_amx(x: jax.Array, w_packed: jax.Array, rows: Any = None) -> jax.Array:  # f32[M, N]
    """x [M, K] @ w [K, N] on AMX tiles, w from `pack_bf16`: bfloat16 inputs, float32
    accumulation and result (like `jnp.dot(x.astype(bf16), w, preferred_element_type=f32)`).
    Computes every row (`rows` is accepted for the common signature and ignored)."""
    return _packed_matmul(MATMUL_AMX_TARGET, x, w_packed)


def matmul_avx512_bf16(x: jax.Array, w_packed: jax.Array, rows: Any = None) -> jax.Array:
    """`matmul_amx`'s contract (f32[M, N]) with AVX512-BF16 dot products (vdpbf16ps) instead
    of tiles. `rows` (i32 scalar or [1], default M): only the first `rows` rows of x are real;
    the others are not computed and come out zero."""
    return _packed_matmul(MATMUL_AVX512_BF16_TARGET, x, w_packed, _real_rows(x, rows))


def matmul_avx512_f32(x: jax.Array, w_packed: jax.Array, rows: Any = None) -> jax.Array:
    """x [M, K] @ w [K, N] in float32 with AVX-512 FMAs, w from `pack_f32` (f32[M, N]);
    `rows` as for `matmul_avx512_bf16`."""
    return _packed_matmul(MATMUL_AVX512_F32_TARGET, x, w_packed, _real_rows(x, rows))


#: Work-item slots of the argmax matmuls' partial results (the kernel uses at most this many
#: items; more than enough to keep a few cores busy on an LM head).
ARGMAX_SLOTS = 64


def _packed_matmul_argmax(
    target: str, x: jax.Array, w_packed: jax.Array, rows: Any
) -> tuple[jax.Array, jax.Array]:
    load()
    m, n = x.shape[0], w_packed.shape[0] * 16
    call = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct((m, n), jnp.float32),
            jax.ShapeDtypeStruct((m, ARGMAX_SLOTS), jnp.float32),
            jax.ShapeDtypeStruct((m, ARGMAX_SLOTS), jnp.int32),
        ),
    )
    out, best_val, best_idx = call(x.astype(w_packed.dtype), w_packed, _real_rows(x, rows))
    # Slots cover increasing column ranges: the first slot holding the row's max holds its
    # first argmax, as jnp.argmax would pick it.
    slot = jnp.argmax(best_val, axis=1)
    return out, jnp.take_along_axis(best_idx, slot[:, None], axis=1)[:, 0]


def matmul_argmax_avx512_bf16(
    x: jax.Array, w_packed: jax.Array, rows: Any = None
) -> tuple[jax.Array, jax.Array]:  # (f32[M, N], i32[M])
    """`matmul_avx512_bf16`, plus the argmax of each output row (first index on ties) taken
    from the accumulators on the way out: an LM head's greedy tokens without another pass
    over its [M, vocab] logits. Padding rows (past `rows`) get token 0."""
    return _packed_matmul_argmax(MATMUL_ARGMAX_AVX512_BF16_TARGET, x, w_packed, rows)


def matmul_argmax_avx512_f32(
    x: jax.Array, w_packed: jax.Array, rows: Any = None
) -> tuple[jax.Array, jax.Array]:  # (f32[M, N], i32[M])
    """`matmul_argmax_avx512_bf16` for `matmul_avx512_f32`."""
    return _packed_matmul_argmax(MATMUL_ARGMAX_AVX512_F32_TARGET, x, w_packed, rows)


def pack_argmax_screen(w: np.ndarray) -> dict[str, np.ndarray]:
    """What `matmul_argmax_screened_f32` needs besides `pack_f32(w)` for a [K, N] float32
    weight: w rounded to bfloat16 in the `pack_bf16` layout, and f32[2, N] column statistics,
    ||w_j|| and ||bf16(w_j) - w_j|| (2-norms, rounded up), the column factors of the bound on
    how far a bf16 product can be from the float32 one."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or not can_pack_bf16(w.shape):
        raise ValueError(f"cannot screen a {list(w.shape)} weight: K must divide by 32, N by 16")
    screen = w.astype(jnp.bfloat16)
    w64 = w.astype(np.float64)
    norms = np.sqrt(np.einsum("kn,kn->n", w64, w64))
    diff = screen.astype(np.float64) - w64
    errors = np.sqrt(np.einsum("kn,kn->n", diff, diff))
    # Rounded up to float32 (and never 0: the bound also covers subnormals flushed to zero).
    stats = np.stack([np.maximum(norms, 2.0**-30), errors]) * (1 + 2.0**-20)
    return {
        "avx512_bf16": pack_bf16(screen),
        "screen_stats": np.nextafter(stats.astype(np.float32), np.inf),
    }


def matmul_argmax_screened_f32(
    x: jax.Array,  # f32[M, K]
    w_packed: jax.Array,  # pack_f32(w)
    screen: dict[str, jax.Array],  # pack_argmax_screen(w)
    rows: Any = None,
) -> tuple[jax.Array, jax.Array]:  # (f32[M, N], i32[M])
    """The greedy tokens of `matmul_argmax_avx512_f32(x, w_packed, rows)`, bit for bit (first
    index on ties), for about the cost of a bf16 matmul: x @ w in bf16, then only the few
    columns whose error bound lets them hold a row's maximum recomputed in float32. The first
    result is the bf16 products, not float32 logits: for callers that need only the tokens."""
    load()
    m, n = x.shape[0], w_packed.shape[0] * 16
    call = jax.ffi.ffi_call(
        MATMUL_ARGMAX_SCREENED_F32_TARGET,
        (jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.int32)),
    )
    return call(
        x.astype(jnp.float32),
        screen["avx512_bf16"],
        w_packed,
        screen["screen_stats"],
        _real_rows(x, rows),
    )


def _packed_swiglu(target: str, x: jax.Array, w_packed: jax.Array, rows: Any) -> jax.Array:
    load()
    if w_packed.shape[0] % 2:
        raise ValueError(f"swiglu needs a [K, 2 * I] weight, I a multiple of 16: {w_packed.shape}")
    i = w_packed.shape[0] * 8
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], i), w_packed.dtype))
    return call(x.astype(w_packed.dtype), w_packed, _real_rows(x, rows))


def swiglu_avx512_bf16(x: jax.Array, w_packed: jax.Array, rows: Any = None) -> jax.Array:
    """silu(gate) * up for gate_up = x @ w, w [K, 2 * I] (gate columns, then up) from
    `pack_bf16`: the matmul of `matmul_avx512_bf16` with the activation in its epilogue,
    written in bfloat16 (the input of the down projection), bf16[M, I]; `rows` as there."""
    return _packed_swiglu(SWIGLU_AVX512_BF16_TARGET, x, w_packed, rows)


def swiglu_avx512_f32(x: jax.Array, w_packed: jax.Array, rows: Any = None) -> jax.Array:
    """`swiglu_avx512_bf16` in float32 (f32[M, I]), w from `pack_f32`."""
    return _packed_swiglu(SWIGLU_AVX512_F32_TARGET, x, w_packed, rows)


class PackedMatmul(NamedTuple):
    # (x, packed weight, real rows=None) -> f32 result; every kernel takes the real-row count
    # of x (the rest is a bucket's padding), the AVX-512 ones skip the padding rows.
    kernel: Callable[..., jax.Array]
    available: Callable[[], bool]  # whether this machine can run it
    dtype: Any  # the weights' dtype it takes
    can_pack: Callable[[tuple[int, ...]], bool]
    pack: Callable[[np.ndarray], np.ndarray]
    isa: str  # what the CPU must have, for errors
    # (x, packed [K, 2 * I] gate_up weight, rows=None) -> silu(gate) * up, or None (not fused)
    swiglu: Callable[..., jax.Array] | None = None
    # (x, packed weight, rows=None) -> (x @ w, argmax of each row), or None
    argmax: Callable[..., tuple[jax.Array, jax.Array]] | None = None


#: kernels.matmul name -> its kernel, in the order "auto" prefers them
PACKED_MATMULS = {
    "amx": PackedMatmul(
        matmul_amx, amx_available, jnp.bfloat16, can_pack_bf16, pack_bf16, "AMX (bf16 tiles)"
    ),
    "avx512_bf16": PackedMatmul(
        matmul_avx512_bf16,
        avx512_bf16_available,
        jnp.bfloat16,
        can_pack_bf16,
        pack_bf16,
        "AVX512-BF16",
        swiglu_avx512_bf16,
        matmul_argmax_avx512_bf16,
    ),
    "avx512": PackedMatmul(
        matmul_avx512_f32,
        avx512_available,
        jnp.float32,
        can_pack_f32,
        pack_f32,
        "AVX-512",
        swiglu_avx512_f32,
        matmul_argmax_avx512_f32,
    ),
}
