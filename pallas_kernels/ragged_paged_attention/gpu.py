"""Ragged paged attention as a Triton (Pallas GPU) kernel.

Grid `(num_q_blocks, num_kv_heads, num_kv_splits)`. One program owns one query block
(`num_queries_per_block` tokens, possibly of several sequences) for one KV head; the `G` query
heads that share the KV head are stacked under the tokens (see common.py), so every K/V page
loaded from HBM serves all of them. The program loops over the sequences that own rows of its
block, and for each over KV blocks of `num_kv_pages_per_block` pages; an online softmax per
row keeps the sequences apart. A KV block is loaded as one 2-D masked gather (each KV row
finds its page in the page table), so only the rows some query can see are read from HBM.

Split-KV (flash-decoding): when the first two grid axes give too few programs for the GPU
(a decode step of a few long sequences), the third axis cuts each sequence's KV blocks into
`num_kv_splits` contiguous shares; each program writes its rows' normalized partial output
(f32) and log-sum-exp, and `_combine_splits` (plain jnp, fused by XLA) merges them. The rule
that picks the factor from static shapes is `tuning.gpu_num_kv_splits`; the block sizes come
from `tuning.gpu_block_sizes` (a table checked for shared-memory fit).

Triton wants every tile dim to be a power of two, and `tl.dot` wants >= 16: G is padded up
to a power of two (the extra heads are zero rows whose output is dropped), head_dim is padded
to Dp (zero q columns; K/V columns past head_dim load as 0 from a masked, clamped address, so
the caller's page layout is untouched; the output is sliced back), and
`num_queries_per_block * G_pad` and `num_kv_pages_per_block * page_size` must be powers of
two >= 16 (checked with ValueError). Loops have dynamic trip counts; every tile is
static-sized and raggedness is handled with masks, never with dynamic shapes.

Quantized pages (int8 / fp8, kv_quant.py): the K/V tiles are loaded as stored (1 byte per
value: half the HBM traffic of bf16) with their per-slot scales (one f32 per KV row, the same
gather without the head_dim axis), converted to q's dtype for the dots (exact: int8 and fp8
values are representable in bf16 and f32), and the scales are folded in: the K scale
multiplies the scores column-wise (`s_ij * k_scale_j`), the V scale the probabilities
(`p_ij * v_scale_j`; the softmax sum keeps plain p). Scales of rows no query sees load as 0.
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
from pallas_kernels.ragged_paged_attention.reference import FULL
from pallas_kernels.ragged_paged_attention.tuning import (
    gpu_block_sizes,
    gpu_num_kv_splits,
    padded_head_dim,
)
from pallas_kernels.ragged_paged_attention.validate import static_validate_inputs


def _kernel(
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


def _combine_splits(
    partial: jax.Array,  # f32[splits, Hkv, R, Dp]: each split's normalized output
    lse: jax.Array,  # f32[splits, Hkv, R]: each split's log-sum-exp (MASK_VALUE if empty)
) -> jax.Array:  # f32[Hkv, R, Dp]
    """Merge split-KV partials: weights exp(lse_j - max lse) renormalize the softmax.

    A row no split saw (padding) has every lse at MASK_VALUE: weights 1, partials 0, out 0.
    """
    weight = jnp.exp(lse - jnp.max(lse, axis=0, keepdims=True))  # [splits, Hkv, R]
    out = jnp.sum(weight[..., None] * partial, axis=0)  # [Hkv, R, Dp]
    return out / jnp.sum(weight, axis=0)[..., None]


def _check_power_of_two(**sizes: int) -> None:
    for name, size in sizes.items():
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two >= 16 for the Triton kernel")


def attention_cost_estimate(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_num_seqs: int,
    pages_per_seq: int,
    num_pages: int,
    page_size: int,
    q_itemsize: int,
    kv_itemsize: int,
    num_kv_splits: int = 1,
    soft_cap: bool = False,
    kv_scales: bool = False,
) -> pl.CostEstimate:
    """What one call costs, from static shapes only (kv_lens are not known at compile time).

    Assumes a full pool: every sequence slot is live, the live KV is
    `min(num_pages * page_size, max_num_seqs * pages_per_seq * page_size)` tokens per KV head
    shared evenly between the slots, each page is read once per KV head (the decode case;
    prefill chunks that span several query blocks re-read it, mostly from L2), and every query
    token attends its sequence's whole share (causal halving ignored). That is an upper bound
    of a decode step at a full pool, the case the roofline is about. Flops count the two
    matmuls (2 * 2 * D per query head and key), not the padding of G and D to powers of two.
    Bytes: q read, output written, K and V read once (with `kv_scales`, quantized pages: their
    f32 scale per KV row too), and the split partials written and read back by the
    combine. Transcendentals: one exp per score (and one tanh with soft_cap).
    """
    live_tokens = min(num_pages * page_size, max_num_seqs * pages_per_seq * page_size)
    keys_per_query = live_tokens / max_num_seqs  # each query token's share of the live KV
    scores = int(num_tokens * num_q_heads * keys_per_query)
    flops = 4 * head_dim * scores
    transcendentals = scores * (2 if soft_cap else 1)
    q_bytes = num_tokens * num_q_heads * head_dim * q_itemsize
    kv_bytes = 2 * num_kv_heads * live_tokens * head_dim * kv_itemsize
    if kv_scales:
        kv_bytes += 2 * num_kv_heads * live_tokens * 4
    table_bytes = 4 * max_num_seqs * (pages_per_seq + 3)
    split_bytes = 0
    if num_kv_splits > 1:  # f32 partial + lse per split, written then read by the combine
        split_bytes = 2 * num_kv_splits * num_tokens * num_q_heads * (head_dim + 1) * 4
    return pl.CostEstimate(
        flops=flops,
        transcendentals=transcendentals,
        bytes_accessed=2 * q_bytes + kv_bytes + table_bytes + split_bytes,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "num_kv_splits",
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
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention on GPU (Triton); semantics of `ragged_paged_attention_reference`.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs: as in the reference.
      sm_scale: score scale, usually head_dim ** -0.5.
      sliding_window: attend only to the last `sliding_window` positions (inclusive of self).
      soft_cap: scores become `soft_cap * tanh(scores / soft_cap)`.
      num_queries_per_block: query tokens per block; raised so that a tile has >= 16 rows.
        None (here and for the next four) takes `tuning.gpu_block_sizes` for these shapes.
      num_kv_pages_per_block: pages per KV block; times page_size a power of two >= 16.
      num_kv_splits: split-KV factor (1: no split); partials merged by `_combine_splits`.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in the Pallas interpreter (CPU), as the tests do.
      k_scales, v_scales: f32 `[num_kv_heads, num_pages, page_size]`, required with int8 /
        fp8 pages (and only then): a stored row stands for its values times its scale.

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
        k_scales=k_scales,
        v_scales=v_scales,
    )
    quantized = k_scales is not None
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    max_num_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    padded_group = pl.next_power_of_2(group)
    padded_dim = padded_head_dim(head_dim)
    chosen = gpu_block_sizes(
        head_dim=head_dim,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        num_tokens=num_tokens,
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
        itemsize=max(q.dtype.itemsize, k_pages.dtype.itemsize),
        kv_scales=quantized,
    )
    block_q = max(
        num_queries_per_block or chosen.num_queries_per_block, 16 // min(padded_group, 16)
    )
    pages_per_block = num_kv_pages_per_block or chosen.num_kv_pages_per_block
    if pages_per_block <= 0:
        raise ValueError(f"{num_kv_pages_per_block=} must be positive")
    _check_power_of_two(
        query_rows_per_block=block_q * padded_group,
        kv_tokens_per_block=pages_per_block * page_size,
    )
    rows = block_q * padded_group
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    splits = num_kv_splits
    if splits is None:  # the rule, for the block sizes actually used
        splits = gpu_num_kv_splits(
            num_q_blocks=num_q_blocks,
            num_kv_heads=num_kv_heads,
            max_kv_blocks=pl.cdiv(pages_per_seq, pages_per_block),
        )
    if splits <= 0:
        raise ValueError(f"{num_kv_splits=} must be positive")

    packed_q = pack_queries(q, num_kv_heads, padded_group, block_q)  # [Hkv, blocks * rows, D]
    if padded_dim != head_dim:  # Triton tiles are powers of two: zero columns up to Dp
        packed_q = jnp.pad(packed_q, ((0, 0), (0, 0), (0, padded_dim - head_dim)))
    first_seq, end_seq = query_block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, block_q)

    kernel = functools.partial(
        _kernel,
        quantized=quantized,
        padded_group=padded_group,
        pages_per_seq=pages_per_seq,
        pages_per_block=pages_per_block,
        num_kv_splits=splits,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    whole = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((pl.squeezed, rows, padded_dim), lambda b, h, j: (h, b, 0))
    kv_spec = pl.BlockSpec(
        (pl.squeezed, num_pages, page_size, head_dim), lambda b, h, j: (h, 0, 0, 0)
    )
    in_specs = [whole, whole, whole, whole, whole, q_spec, kv_spec, kv_spec]
    scale_args = ()
    if quantized:
        scale_spec = pl.BlockSpec((pl.squeezed, num_pages, page_size), lambda b, h, j: (h, 0, 0))
        in_specs += [scale_spec, scale_spec]
        scale_args = (k_scales, v_scales)
    packed_rows = packed_q.shape[1]
    if splits == 1:
        out_specs = q_spec
        out_shape = jax.ShapeDtypeStruct(packed_q.shape, q.dtype)
    else:  # per split: f32 partial [rows, Dp] and log-sum-exp [rows]
        out_specs = (
            pl.BlockSpec(
                (pl.squeezed, pl.squeezed, rows, padded_dim), lambda b, h, j: (j, h, b, 0)
            ),
            pl.BlockSpec((pl.squeezed, pl.squeezed, rows), lambda b, h, j: (j, h, b)),
        )
        out_shape = (
            jax.ShapeDtypeStruct((splits, num_kv_heads, packed_rows, padded_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_kv_heads, packed_rows), jnp.float32),
        )
    cost = attention_cost_estimate(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
        num_pages=num_pages,
        page_size=page_size,
        q_itemsize=q.dtype.itemsize,
        kv_itemsize=k_pages.dtype.itemsize,
        num_kv_splits=splits,
        soft_cap=soft_cap is not None,
        kv_scales=quantized,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or chosen.num_warps,
            num_stages=num_stages or chosen.num_stages,
        ),
        cost_estimate=cost,
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
        *scale_args,
    )
    if splits > 1:
        out = _combine_splits(*out).astype(q.dtype)  # [Hkv, T_pad * Gp, Dp]
    return unpack_outputs(out[..., :head_dim], num_tokens, num_q_heads, padded_group)
