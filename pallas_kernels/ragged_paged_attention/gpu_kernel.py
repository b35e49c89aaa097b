"""The body of the Triton (Pallas GPU) ragged paged attention kernel (one program: a query
block, a KV head and a share of the KV blocks), and the merge of the split-KV partials it
writes; gpu.py has the design, the block sizes, the grid and the pallas_call around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention.common import MASK_VALUE
from pallas_kernels.ragged_paged_attention.reference import FULL


def kernel(
    kv_lens_ref,  # i32[S]
    page_indices_ref,  # i32[S * pages_per_seq]
    cu_q_lens_ref,  # i32[S + 1]
    first_seq_ref,  # i32[num_q_blocks]
    end_seq_ref,  # i32[num_q_blocks]
    q_ref,  # [rows, Dp], rows = num_queries_per_block * padded_group, Dp = padded head_dim
    k_ref,  # [num_pages, page_size, D] (this program's KV head)
    v_ref,  # [num_pages, page_size, D]
    *refs,  # quantized: k_scales_ref, v_scales_ref f32[num_pages, page_size]; then o_ref
    # o_ref: [rows, Dp]: the output (one split), else this split's normalized partial (f32);
    # then, with several splits, lse_ref [rows] f32: this split's log-sum-exp per row
    quantized: bool,
    padded_group: int,
    pages_per_seq: int,
    pages_per_block: int,
    num_kv_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    if quantized:
        k_scales_ref, v_scales_ref, o_ref, *lse_ref = refs
    else:
        o_ref, *lse_ref = refs
    q_block, split = pl.program_id(0), pl.program_id(2)
    rows, padded_dim = q_ref.shape
    _, page_size, head_dim = k_ref.shape
    block_q = rows // padded_group
    kv_block = pages_per_block * page_size
    row_begin = q_block * block_q
    row_end = row_begin + block_q

    q = q_ref[...]  # [rows, Dp]
    token = row_begin + jnp.arange(rows, dtype=jnp.int32) // padded_group  # [rows]
    block_offsets = jnp.arange(kv_block, dtype=jnp.int32)  # [kv_block]
    slot_of_row = block_offsets % page_size  # [kv_block]: slot in its page of each KV row
    # Columns past head_dim (padding up to a power of two) load as 0 from a clamped, in-bounds
    # address; q holds zeros there too, so scores are unchanged and the extra output is 0.
    dim_index = jnp.arange(padded_dim, dtype=jnp.int32)  # [Dp]
    dim_live = dim_index < head_dim  # [Dp]
    dim_index = jnp.minimum(dim_index, head_dim - 1)

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
        if num_kv_splits > 1:
            # Split-KV: this program takes the `split`-th contiguous share of the KV blocks
            # (an empty loop where the sequence has fewer blocks than splits).
            per_split = pl.cdiv(end_blk - first_blk, num_kv_splits)
            first_blk = first_blk + split * per_split
            end_blk = jnp.minimum(first_blk + per_split, end_blk)
        in_seq = (token >= q_start) & (token < q_end)  # [rows]
        q_pos = context + token - q_start  # [rows]

        def kv_body(blk, carry):
            m_prev, l_prev, acc_prev = carry  # [rows], [rows], [rows, Dp]
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
            load_mask = visible[:, None]
            if padded_dim != head_dim:
                load_mask = load_mask & dim_live[None, :]
            load_mask = jnp.broadcast_to(load_mask, (kv_block, padded_dim))
            zero = jnp.zeros((), k_ref.dtype)  # typed: Triton casts no i32 constant to fp8
            k = pltriton.load(k_ref.at[gather], mask=load_mask, other=zero)  # [kv_block, Dp]
            v = pltriton.load(v_ref.at[gather], mask=load_mask, other=zero)  # [kv_block, Dp]
            if quantized:  # values as stored, to q's dtype for the dots; scales per KV row
                k, v = k.astype(q.dtype), v.astype(q.dtype)
                scale_at = (page, slot_of_row)
                k_scale = pltriton.load(k_scales_ref.at[scale_at], mask=visible, other=0.0)
                v_scale = pltriton.load(v_scales_ref.at[scale_at], mask=visible, other=0.0)

            scores = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=FULL, preferred_element_type=jnp.float32
            )  # [rows, kv_block]
            if quantized:
                scores = scores * k_scale[None, :]
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
            if quantized:
                p = p * v_scale[None, :]
            pv = lax.dot_general(
                p.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=FULL,
                preferred_element_type=jnp.float32,
            )  # [rows, Dp]
            return m_next, l_next, acc_prev * alpha[:, None] + pv

        return lax.fori_loop(first_blk, end_blk, kv_body, carry)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, padded_dim), jnp.float32),
    )
    m, denom, acc = lax.fori_loop(first_seq_ref[q_block], end_seq_ref[q_block], seq_body, init)
    seen = denom > 0.0  # padding rows and rows whose split saw no key: 0 / 1 = 0
    o_ref[...] = (acc / jnp.where(seen, denom, 1.0)[:, None]).astype(o_ref.dtype)
    if num_kv_splits > 1:
        lse_ref[0][...] = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), MASK_VALUE)


def combine_splits(
    partial: jax.Array,  # f32[splits, Hkv, R, Dp]: each split's normalized output
    lse: jax.Array,  # f32[splits, Hkv, R]: each split's log-sum-exp (MASK_VALUE if empty)
) -> jax.Array:  # f32[Hkv, R, Dp]
    """Merge split-KV partials: weights exp(lse_j - max lse) renormalize the softmax.

    A row no split saw (padding) has every lse at MASK_VALUE: weights 1, partials 0, out 0.
    """
    weight = jnp.exp(lse - jnp.max(lse, axis=0, keepdims=True))  # [splits, Hkv, R]
    out = jnp.sum(weight[..., None] * partial, axis=0)  # [Hkv, R, Dp]
    return out / jnp.sum(weight, axis=0)[..., None]
