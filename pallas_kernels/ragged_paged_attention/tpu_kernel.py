"""The body of the Mosaic TPU ragged paged attention kernel (one grid step: a KV head and a
query block); tpu.py has the design, the grid and the pallas_call around it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.common import MASK_VALUE

#: Softmax max/sum are kept replicated over one vreg of lanes: full-width loads and stores.
LANES = 128

#: Page ids per page-table copy: 128 ids of one row are one contiguous 512-byte run of the
#: (8, 128)-tiled table in HBM, so the copy is a single aligned burst (against 64 KiB of K/V
#: per KV block of 8 pages x 16 tokens x 128 dims).
IDS_CHUNK = 128


def _div(a, b):
    """Floor division of non-negative ints; `//` on tracers emits sign fix-ups Mosaic lowers
    only with a real TPU attached."""
    return lax.div(a, jnp.int32(b))


def _cdiv(a, b):
    return _div(a + (b - 1), b)


def _start_or_wait(copies, wait: bool) -> None:
    for copy in copies:
        copy.wait() if wait else copy.start()


def _scale_column(
    scales_ref,  # f32[page_size, num_pages] (VMEM): one KV head's scales, pages on lanes
    page,  # i32 scalar: a page id in [0, num_pages)
) -> jax.Array:  # f32[page_size, 1]: the scales of the page's slots
    """Column `page` of `scales_ref`: the aligned 128-lane chunk that holds it, its lane
    selected and summed (Mosaic loads lanes in aligned 128-lane chunks). A pool whose page
    count is no multiple of 128 has a narrower last chunk, read with its own static slice."""
    num_pages = scales_ref.shape[1]

    def pick(start, width, lane):
        chunk = scales_ref[:, pl.ds(start, width)]  # [page_size, width]
        lanes = lax.broadcasted_iota(jnp.int32, chunk.shape, 1)
        return jnp.sum(jnp.where(lanes == lane, chunk, 0.0), axis=1, keepdims=True)

    full = num_pages // LANES * LANES  # pages in whole chunks
    if full == 0:
        return pick(0, num_pages, page)
    start = pl.multiple_of(_div(jnp.minimum(page, full - 1), LANES) * LANES, LANES)
    column = pick(start, LANES, page - start)
    if full == num_pages:
        return column
    return jnp.where(page >= full, pick(full, num_pages - full, page - full), column)


def kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S + 1]
    first_seq_ref,  # i32[num_q_blocks]
    end_seq_ref,  # i32[num_q_blocks]
    # inputs
    q_ref,  # [rows, D] (VMEM block), rows = num_queries_per_block * G
    table_hbm_ref,  # i32[S, chunks_per_seq * ids_chunk] (HBM): the page table
    k_hbm_ref,  # [Hkv, num_pages, page_size, D] (HBM)
    v_hbm_ref,  # [Hkv, num_pages, page_size, D] (HBM)
    *refs,
    # quantized only: k_scales_ref, v_scales_ref f32[page_size, num_pages] (VMEM, this head)
    # output: o_ref [rows, D]
    # scratch:
    #   k_buf, v_buf [2, kv_block_tokens, D]
    #   sems DMA[2, 2]: (K or V, buffer slot)
    #   ids_buf i32[2, 1, ids_chunk] (SMEM): the table chunk of a KV block, per buffer slot
    #   ids_sems DMA[2]: per buffer slot
    #   m_ref f32[rows, LANES] running max (replicated over lanes)
    #   l_ref f32[rows, LANES] running sum
    #   acc_ref f32[rows, D] running numerator
    #   quantized only: pages_buf i32[2, pages_per_block] (SMEM): a KV block's page ids
    quantized: bool,
    group: int,
    page_size: int,
    ids_chunk: int,
    pages_per_block: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    if quantized:
        k_scales_ref, v_scales_ref, *refs = refs
        *refs, pages_buf = refs
    o_ref, k_buf, v_buf, sems, ids_buf, ids_sems, m_ref, l_ref, acc_ref = refs
    head = pl.program_id(0)
    q_block = pl.program_id(1)
    rows, head_dim = q_ref.shape
    block_q = rows // group
    kv_block = pages_per_block * page_size
    row_begin = q_block * block_q  # first token of this block
    row_end = row_begin + block_q
    seq_end = end_seq_ref[q_block]

    def span(s):
        """Where sequence `s` meets this block: token rows, context and KV range."""
        q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
        context = kv_lens_ref[s] - (q_end - q_start)  # position of row q_start
        lo, hi = jnp.maximum(q_start, row_begin), jnp.minimum(q_end, row_end)
        kv_stop = context + hi - q_start  # causal end (exclusive) of the block's rows
        kv_first = 0
        if sliding_window is not None:
            kv_first = jnp.maximum(context + lo - q_start - sliding_window + 1, 0)
        first_blk = _div(kv_first, kv_block)
        end_blk = jnp.where(hi > lo, _cdiv(kv_stop, kv_block), first_blk)
        return q_start, q_end, context, kv_stop, first_blk, end_blk

    def clamp(s):
        # Keeps SMEM reads in bounds where a result is computed but not used.
        return jnp.clip(s, 0, kv_lens_ref.shape[0] - 1)

    def has_work(s):
        _, _, _, _, first_blk, end_blk = span(clamp(s))
        return (s < seq_end) & (end_blk > first_blk)

    def first_work(s):
        """The first sequence >= s with work in this block, and its first KV block."""
        s = lax.while_loop(lambda t: (t < seq_end) & ~has_work(t), lambda t: t + 1, s)
        return s, span(clamp(s))[4]

    def advance(s, blk):
        """The work item after (s, blk): the next KV block of s, else the next sequence with
        work. Past `seq_end` it stays past it."""
        more_here = (s < seq_end) & (blk + 1 < span(clamp(s))[5])
        s_after, blk_after = first_work(s + 1)
        return jnp.where(more_here, s, s_after), jnp.where(more_here, blk + 1, blk_after)

    def ids_copy(s, blk, slot):
        """The copy of the table chunk holding KV block `blk` of `s` into ids slot `slot`
        (a chunk holds whole KV blocks: ids_chunk is a multiple of pages_per_block)."""
        chunk = _div(blk * pages_per_block, ids_chunk)
        start = pl.multiple_of(chunk * ids_chunk, IDS_CHUNK)
        return pltpu.make_async_copy(
            table_hbm_ref.at[pl.ds(s, 1), pl.ds(start, ids_chunk)],
            ids_buf.at[slot],
            ids_sems.at[slot],
        )

    def fetch(s, blk, slot, *, wait: bool):
        """Start (or wait for) the copies of the pages of KV block `blk` of `s` that hold
        tokens some row can see; the rest of the buffer keeps stale data, masked later.
        Starting reads the block's page ids from ids slot `slot`; a wait needs only the
        copy sizes and semaphores, so it reads none (the slot may hold the next ids)."""
        num_needed = _cdiv(span(s)[3], page_size) - blk * pages_per_block
        first_id = lax.rem(blk * pages_per_block, jnp.int32(ids_chunk))  # in the chunk
        for j in range(pages_per_block):
            page = 0 if wait else ids_buf[slot, 0, first_id + j]
            rows_j = pl.ds(j * page_size, page_size)
            copies = (
                pltpu.make_async_copy(
                    k_hbm_ref.at[head, page], k_buf.at[slot, rows_j], sems.at[0, slot]
                ),
                pltpu.make_async_copy(
                    v_hbm_ref.at[head, page], v_buf.at[slot, rows_j], sems.at[1, slot]
                ),
            )
            pl.when(j < num_needed)(functools.partial(_start_or_wait, copies, wait))
            if quantized and not wait:  # kept for the scales: ids_buf moves on before compute
                pages_buf[slot, j] = jnp.where(j < num_needed, page, 0)

    def scales_tile(scales_ref, slot):
        """f32[kv_block, D]: row r holds the scale of the block's token r (its page's column
        of the head's `[page_size, num_pages]` scales, broadcast over the lanes)."""
        columns = []
        for j in range(pages_per_block):
            column = _scale_column(scales_ref, pages_buf[slot, j])  # [page_size, 1]
            columns.append(jnp.broadcast_to(column, (page_size, head_dim)))
        return jnp.concatenate(columns, axis=0) if len(columns) > 1 else columns[0]

    def compute(s, blk, slot):
        q_start, q_end, context, kv_stop, _, _ = span(s)
        kv_base = blk * kv_block
        # Tokens past the causal end were not copied (stale or NaN): zero V there so that
        # p == 0 cannot turn into 0 * NaN.
        v_pos = kv_base + lax.broadcasted_iota(jnp.int32, (kv_block, head_dim), 0)
        if quantized:  # dequantized row by row; K past the causal end is masked below
            k = k_buf[slot].astype(jnp.float32) * scales_tile(k_scales_ref, slot)
            k = k.astype(q_ref.dtype)  # [kv_block, D]
            v = v_buf[slot].astype(jnp.float32) * scales_tile(v_scales_ref, slot)
            v = jnp.where(v_pos < kv_stop, v, 0).astype(q_ref.dtype)  # [kv_block, D]
        else:
            v = jnp.where(v_pos < kv_stop, v_buf[slot], 0)  # [kv_block, D]
            k = k_buf[slot]  # [kv_block, D]
        scores = lax.dot_general(
            q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [rows, kv_block]
        scores = scores * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        # Row r is token row_begin + r // group. For an integer a, token >= a <=> r >= (a -
        # row_begin) * group and token < a <=> r < (a - row_begin) * group, so the masks
        # need no vector integer division (the TPU VPU has none).
        row = lax.broadcasted_iota(jnp.int32, scores.shape, 0)  # [rows, kv_block]
        kv_pos = kv_base + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        first_token = q_start - context  # token whose position would be 0

        def rows_before(token):
            return (token - row_begin) * group

        mask = (row >= rows_before(q_start)) & (row < rows_before(q_end))
        mask &= row >= rows_before(kv_pos + first_token)  # causal: kv_pos <= q_pos
        if sliding_window is not None:  # kv_pos > q_pos - sliding_window
            mask &= row < rows_before(kv_pos + first_token + sliding_window)
        scores = jnp.where(mask, scores, MASK_VALUE)

        m_prev = m_ref[...]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # [rows, LANES]
        alpha = jnp.exp(m_prev - m_next)  # rows of other sequences: exp(0) = 1, unchanged
        p = jnp.where(mask, jnp.exp(scores - m_next[:, :1]), 0.0)  # [rows, kv_block]
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [rows, D]
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv

    # Work item i (a KV block of a sequence) uses K/V slot i % 2 and ids slot i % 2. The
    # first ids copy overlaps the state init and the search for the second item.
    s0, blk0 = first_work(first_seq_ref[q_block])

    @pl.when(s0 < seq_end)
    def _():
        ids_copy(s0, blk0, 0).start()

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    s1, blk1 = advance(s0, blk0)

    @pl.when(s0 < seq_end)
    def _():
        ids_copy(s0, blk0, 0).wait()
        fetch(s0, blk0, 0, wait=False)

    @pl.when(s1 < seq_end)
    def _():
        ids_copy(s1, blk1, 1).start()

    def body(carry):
        s, blk, slot, next_s, next_blk = carry

        @pl.when(next_s < seq_end)
        def _():
            ids_copy(next_s, next_blk, 1 - slot).wait()
            fetch(next_s, next_blk, 1 - slot, wait=False)

        # Slot `slot` held this item's ids, already used to start its K/V copies.
        after_s, after_blk = advance(next_s, next_blk)

        @pl.when(after_s < seq_end)
        def _():
            ids_copy(after_s, after_blk, slot).start()

        fetch(s, blk, slot, wait=True)
        compute(s, blk, slot)
        return next_s, next_blk, 1 - slot, after_s, after_blk

    lax.while_loop(lambda c: c[0] < seq_end, body, (s0, blk0, jnp.int32(0), s1, blk1))

    denom = l_ref[...][:, :1]  # [rows, 1]
    out = acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)  # padding rows: 0 / 1 = 0
    o_ref[...] = out.astype(o_ref.dtype)
