"""Ragged paged attention test batches: (q_len, kv_len) lists -> kernel inputs.

Every batch is built so that a kernel reading anything it should not poisons its output:
pages no live sequence uses, and the unused tail slots of partly filled pages, hold NaN;
page tables are shuffled; columns of a page table past a sequence's last page hold an
out-of-range page index; padding query rows hold NaN too.

Quantized pages (`quantize_batch`): the slots that hold NaN above get a NaN scale (and NaN
values where the dtype has NaN, fp8; int8 ones hold 127), so a kernel that reads a scale or
a value it should not still poisons its output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import QUANTIZED_KV_DTYPES, kv_pages_shape, quantize_rows


@dataclasses.dataclass(frozen=True)
class Shape:
    """Everything static about a batch: one compiled kernel per Shape."""

    num_tokens: int = 16  # T, query rows including padding
    max_num_seqs: int = 4  # S
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    num_pages: int = 24
    pages_per_seq: int = 4
    dtype: str = "float32"


def make_batch(
    shape: Shape,
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per live sequence
    seed: int = 0,
) -> tuple[jax.Array, ...]:
    """`(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)` for `seqs`."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(shape.dtype)
    n = len(seqs)
    if n > shape.max_num_seqs:
        raise ValueError(f"{n} sequences do not fit {shape.max_num_seqs=}")
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.zeros(shape.max_num_seqs, np.int32)
    kv_lens[:n] = [kv for _, kv in seqs]
    cu_q_lens = np.zeros(shape.max_num_seqs + 1, np.int32)
    cu_q_lens[1 : n + 1] = np.cumsum(q_lens)
    cu_q_lens[n + 1 :] = cu_q_lens[n]
    if cu_q_lens[n] > shape.num_tokens:
        raise ValueError(f"{cu_q_lens[n]} query tokens do not fit {shape.num_tokens=}")

    pages_needed = [-(-kv // shape.page_size) for _, kv in seqs]
    if sum(pages_needed) > shape.num_pages:
        raise ValueError(f"{sum(pages_needed)} pages do not fit {shape.num_pages=}")
    free = rng.permutation(shape.num_pages)
    # Columns past a sequence's last page: an index no pool has, as a stale table might hold.
    page_indices = np.full((shape.max_num_seqs, shape.pages_per_seq), 10**6, np.int32)
    pool_shape = kv_pages_shape(
        shape.num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim
    )
    k_pages = np.full(pool_shape, np.nan, np.float32)
    v_pages = np.full(pool_shape, np.nan, np.float32)
    used = 0
    for s, (_, kv_len) in enumerate(seqs):
        pages = free[used : used + pages_needed[s]]
        used += pages_needed[s]
        page_indices[s, : len(pages)] = pages
        for j, page in enumerate(pages):
            filled = min(shape.page_size, kv_len - j * shape.page_size)
            for pages_arr in (k_pages, v_pages):
                pages_arr[:, page, :filled] = rng.standard_normal(
                    (shape.num_kv_heads, filled, shape.head_dim)
                )

    q = rng.standard_normal((shape.num_tokens, shape.num_q_heads, shape.head_dim))
    q[cu_q_lens[n] :] = np.nan
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(kv_lens),
        jnp.asarray(page_indices),
        jnp.asarray(cu_q_lens),
        jnp.asarray([n], jnp.int32),
    )


def quantize_batch(
    batch: tuple[jax.Array, ...],  # make_batch's seven arrays, float pages
    kv_dtype: str,  # "int8", "fp8_e4m3" or "fp8_e5m2"
) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array]]:
    """The batch with its pages quantized, and `{"k_scales": ..., "v_scales": ...}`.

    Every row that holds NaN (unused pages, tails of partly filled pages) gets a NaN scale,
    and NaN values in fp8 (int8 has no NaN: 127), whatever `quantize_rows` makes of NaN."""
    dtype = QUANTIZED_KV_DTYPES[kv_dtype]
    q, k_pages, v_pages, *metadata = batch
    pages, scales = [], {}
    for name, x in (("k_scales", k_pages), ("v_scales", v_pages)):
        unused = np.isnan(np.asarray(x.astype(jnp.float32))).any(axis=-1)  # [H, P, ps]
        values, scale = quantize_rows(jnp.nan_to_num(x), dtype)
        poison = jnp.asarray(127 if dtype == jnp.int8 else np.nan, dtype)
        pages.append(jnp.where(unused[..., None], poison, values))
        scales[name] = jnp.where(unused, jnp.float32(np.nan), scale)
    return (q, *pages, *metadata), scales


def abstract_args(
    shape: Shape, sharding=None, kv_dtype: str | None = None
) -> list[jax.ShapeDtypeStruct]:
    """The kernel's seven arguments as abstract values (lowering, AOT compiles); pages of
    `kv_dtype` ("int8", "fp8_e4m3", "fp8_e5m2") if given (their scales: `abstract_scales`)."""
    s = shape.max_num_seqs
    kv = (shape.num_kv_heads, shape.num_pages, shape.page_size, shape.head_dim)
    page_dtype = QUANTIZED_KV_DTYPES[kv_dtype] if kv_dtype else shape.dtype
    shapes_dtypes = [
        ((shape.num_tokens, shape.num_q_heads, shape.head_dim), shape.dtype),
        (kv, page_dtype),
        (kv, page_dtype),
        ((s,), jnp.int32),
        ((s, shape.pages_per_seq), jnp.int32),
        ((s + 1,), jnp.int32),
        ((1,), jnp.int32),
    ]
    return [jax.ShapeDtypeStruct(x, dtype, sharding=sharding) for x, dtype in shapes_dtypes]


def abstract_scales(shape: Shape, sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
    """`k_scales` and `v_scales` of a quantized pool of `shape`, as abstract values."""
    scales = (shape.num_kv_heads, shape.num_pages, shape.page_size)
    abstract = jax.ShapeDtypeStruct(scales, jnp.float32, sharding=sharding)
    return {"k_scales": abstract, "v_scales": abstract}


#: Tolerances per dtype. float32 errors are ~1e-6. bfloat16: the kernels round p to bf16
#: before p @ v (the reference does not) and both round the output, so they may land 1-2 bf16
#: ulps apart (an ulp is 2**-7 relative; 0.0156 at |x| ~ 2 is the largest seen).
TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=1e-2, rtol=1.6e-2)}


def assert_matches_reference(out: jax.Array, expected: jax.Array, batch, dtype: str) -> None:
    """Equal to the reference on real rows, exactly zero on padding rows, NaN-free."""
    cu_q_lens, num_seqs = batch[5], batch[6]
    num_real = int(cu_q_lens[int(num_seqs[0])])
    out = np.asarray(out.astype(jnp.float32))
    expected = np.asarray(expected.astype(jnp.float32))
    assert np.all(np.isfinite(out)), "kernel output holds NaN/inf (stray read of a NaN page?)"
    np.testing.assert_allclose(out[:num_real], expected[:num_real], **TOLERANCE[dtype])
    np.testing.assert_array_equal(out[num_real:], 0.0)
