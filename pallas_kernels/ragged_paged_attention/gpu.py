"""Ragged paged attention as a Triton (Pallas GPU) kernel.

Grid `(num_q_blocks, num_kv_heads)`. One program owns one query block (`num_queries_per_block`
tokens, possibly of several sequences) for one KV head; the `G` query heads that share the KV
head are stacked under the tokens (see common.py), so every K/V page loaded from HBM serves
all of them. The program loops over the sequences that own rows of its block, and for each
over KV blocks of `num_kv_pages_per_block` pages; an online softmax per row keeps the
sequences apart. A KV block is loaded as one 2-D masked gather (each KV row finds its page in
the page table), so only the rows some query can see are read from HBM.

Triton wants every tile dim to be a power of two, and `tl.dot` wants >= 16: G is padded up
to a power of two (the extra heads are zero rows whose output is dropped), and
`head_dim`, `num_queries_per_block * G_pad` and `num_kv_pages_per_block * page_size` must be
powers of two >= 16 (checked with ValueError). Loops have dynamic trip counts; every tile is
static-sized and raggedness is handled with masks, never with dynamic shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention.common import (
    MASK_VALUE,
    pack_queries,
    query_block_seq_ranges,
    unpack_outputs,
)
from pallas_kernels.ragged_paged_attention.tuning import default_block_sizes
from pallas_kernels.ragged_paged_attention.validate import static_validate_inputs


def _kernel(
    kv_lens_ref,  # i32[S]
    page_indices_ref,  # i32[S * pages_per_seq]
    cu_q_lens_ref,  # i32[S + 1]
    first_seq_ref,  # i32[num_q_blocks]
    end_seq_ref,  # i32[num_q_blocks]
    q_ref,  # [rows, D], rows = num_queries_per_block * padded_group
    k_ref,  # [num_pages, page_size, D] (this program's KV head)
    v_ref,  # [num_pages, page_size, D]
    o_ref,  # [rows, D]
    *,
    padded_group: int,
    pages_per_seq: int,
    pages_per_block: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    q_block = pl.program_id(0)
    rows, head_dim = q_ref.shape
    _, page_size, _ = k_ref.shape
    block_q = rows // padded_group
    kv_block = pages_per_block * page_size
    row_begin = q_block * block_q
    row_end = row_begin + block_q

    q = q_ref[...]  # [rows, D]
    token = row_begin + jnp.arange(rows, dtype=jnp.int32) // padded_group  # [rows]
    block_offsets = jnp.arange(kv_block, dtype=jnp.int32)  # [kv_block]
    slot_of_row = block_offsets % page_size  # [kv_block]: slot in its page of each KV row
    dim_index = jnp.arange(head_dim, dtype=jnp.int32)  # [D]

    def seq_body(s, carry):
        q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
        context = kv_lens_ref[s] - (q_end - q_start)  # position of row q_start
        lo, hi = jnp.maximum(q_start, row_begin), jnp.minimum(q_end, row_end)
        kv_stop = context + hi - q_start  # causal end (exclusive) of the block's rows
        kv_first = 0
        if sliding_window is not None:
            kv_first = jnp.maximum(context + lo - q_start - sliding_window + 1, 0)
        first_blk = kv_first // kv_block
        end_blk = jnp.where(hi > lo, pl.cdiv(kv_stop, kv_block), first_blk)
        in_seq = (token >= q_start) & (token < q_end)  # [rows]
        q_pos = context + token - q_start  # [rows]

        def kv_body(blk, carry):
            m_prev, l_prev, acc_prev = carry  # [rows], [rows], [rows, D]
            kv_pos = blk * kv_block + block_offsets  # [kv_block]
            # Only KV rows some query row can see are read: the rest of the tile (past the
            # causal end, before the window, the NaN tails of pages) loads as 0, so V holds
            # no NaN for p == 0 to multiply. Each KV row looks up its page in the table
            # (repeated addresses hit the cache) and the K/V loads are 2-D gathers: no
            # reshape, no dynamic shapes.
            visible = (kv_pos >= kv_first) & (kv_pos < kv_stop)  # [kv_block]
            table_col = s * pages_per_seq + kv_pos // page_size  # [kv_block]
            page = pltriton.load(page_indices_ref.at[table_col], mask=visible, other=0)
            gather = (page[:, None], slot_of_row[:, None], dim_index[None, :])
            load_mask = jnp.broadcast_to(visible[:, None], (kv_block, head_dim))
            k = pltriton.load(k_ref.at[gather], mask=load_mask, other=0)  # [kv_block, D]
            v = pltriton.load(v_ref.at[gather], mask=load_mask, other=0)  # [kv_block, D]

            scores = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )  # [rows, kv_block]
            scores = scores * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            mask = in_seq[:, None] & (kv_pos[None, :] <= q_pos[:, None])
            if sliding_window is not None:
                mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            scores = jnp.where(mask, scores, MASK_VALUE)

            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))  # [rows]
            alpha = jnp.exp(m_prev - m_next)  # rows of other sequences: 1
            p = jnp.where(mask, jnp.exp(scores - m_next[:, None]), 0.0)  # [rows, kv_block]
            l_next = alpha * l_prev + jnp.sum(p, axis=1)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )  # [rows, D]
            return m_next, l_next, acc_prev * alpha[:, None] + pv

        return lax.fori_loop(first_blk, end_blk, kv_body, carry)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, denom, acc = lax.fori_loop(first_seq_ref[q_block], end_seq_ref[q_block], seq_body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]  # padding rows: 0 / 1 = 0
    o_ref[...] = out.astype(o_ref.dtype)


def _check_power_of_two(**sizes: int) -> None:
    for name, size in sizes.items():
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 for the Triton kernel")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def ragged_paged_attention_gpu(
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
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention on GPU (Triton); semantics of `ragged_paged_attention_reference`.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs: as in the reference.
      sm_scale: score scale, usually head_dim ** -0.5.
      sliding_window: attend only to the last `sliding_window` positions (inclusive of self).
      soft_cap: scores become `soft_cap * tanh(scores / soft_cap)`.
      num_queries_per_block: query tokens per block; raised so that a tile has >= 16 rows.
        None takes tuning.DEFAULT_BLOCK_SIZES["gpu"]; same for the next three.
      num_kv_pages_per_block: pages per KV block; times page_size a power of two >= 16.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in the Pallas interpreter (CPU), as the tests do.

    Returns:
      `[T, num_q_heads, head_dim]` in q's dtype; padding rows are zeros.
    """
    static_validate_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_num_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    padded_group = pl.next_power_of_2(group)
    defaults = default_block_sizes("gpu", head_dim, page_size)
    block_q = num_queries_per_block or defaults.num_queries_per_block
    block_q = max(block_q, 16 // min(padded_group, 16))
    pages_per_block = num_kv_pages_per_block or defaults.num_kv_pages_per_block
    if pages_per_block <= 0:
        raise ValueError(f"{num_kv_pages_per_block=} must be positive")
    _check_power_of_two(
        head_dim=head_dim,
        query_rows_per_block=block_q * padded_group,
        kv_tokens_per_block=pages_per_block * page_size,
    )
    rows = block_q * padded_group
    num_q_blocks = pl.cdiv(num_tokens, block_q)

    packed_q = pack_queries(q, num_kv_heads, padded_group, block_q)  # [Hkv, blocks * rows, D]
    first_seq, end_seq = query_block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, block_q)

    kernel = functools.partial(
        _kernel,
        padded_group=padded_group,
        pages_per_seq=pages_per_seq,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    num_pages = k_pages.shape[1]
    whole = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((pl.squeezed, rows, head_dim), lambda b, h: (h, b, 0))
    kv_spec = pl.BlockSpec((pl.squeezed, num_pages, page_size, head_dim), lambda b, h: (h, 0, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads),
        in_specs=[whole, whole, whole, whole, whole, q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(packed_q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or defaults.num_warps,
            num_stages=num_stages or defaults.num_stages,
        ),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        kv_lens,
        page_indices.reshape(max_num_seqs * pages_per_seq),
        cu_q_lens,
        first_seq,
        end_seq,
        packed_q,
        k_pages,
        v_pages,
    )
    return unpack_outputs(out, num_tokens, num_q_heads, padded_group)
