"""Ragged paged attention in XLA, shaped for speed: the CPU path of the engine.

Same semantics as `reference.py`, which gathers every query row's whole page table: simple,
but its cost is `T x max_model_len` K/V reads. This version reads K/V once per *sequence*
(decode) or once per *block of query rows of one sequence* (prefill), and only up to the
longest live sequence, with an online softmax over KV chunks in a `while` loop whose trip
count is the data's, not the bucket's:

- decode path: every sequence with one query row (its newest token) attends over KV chunks
  of `kv_chunk_pages` pages gathered for all sequences at once: `[S, chunk]` reads.
- prefill path: the rows of sequences with more than one query row are cut into blocks of
  `block_q` rows that never span two sequences; blocks are processed `block_group` at a time
  (a loop over as many groups as there are blocks), each group over the KV chunks its
  rows can see.

Both paths zero masked K/V before any arithmetic, so garbage (NaN) in pages that a sequence
does not own cannot leak into its output; padding rows produce zeros.

Quantized pages (int8 / fp8 with `k_scales` / `v_scales`, kv_quant.py): chunks are gathered
as stored, with their scales; the K scale multiplies the scores (`s_ij * k_scale_j`) and the
V scale the probabilities (`p_ij * v_scale_j`, the softmax sum keeps plain p), so no
dequantized copy of a chunk is made. Masked scales are zeroed like masked V (0 * NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention.kv_quant import check_scales
from pallas_kernels.ragged_paged_attention.reference import FULL, MASK_VALUE


def _online_softmax_step(carry, scores, mask, v, out_dtype, *, as_matmul=True, v_scale=None):
    """One KV chunk of an online softmax.

    carry: (m [Hkv, N, R], denom [Hkv, N, R], acc [Hkv, N, R, D]); scores, mask:
    [Hkv, N, R, C]; v: [Hkv, N, C, D]; v_scale (quantized V): f32[Hkv, N, C], zero where
    masked.
    """
    m, denom, acc = carry
    scores = jnp.where(mask, scores, MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None]) * mask
    denom = denom * alpha + p.sum(axis=-1)
    if v_scale is not None:  # the V scale folded into the probabilities
        p = p * v_scale[:, :, None, :]
        v = v.astype(out_dtype)
    if as_matmul:
        pv = jnp.einsum(
            "hnrc,hncd->hnrd",
            p.astype(out_dtype),
            v,
            preferred_element_type=jnp.float32,
            precision=FULL,
        )
    else:  # multiply-and-reduce: XLA fuses it with the gather of v, nothing materialized
        pv = jnp.sum(p[..., None] * v[:, :, None, :, :].astype(jnp.float32), axis=-2)
    return m_new, denom, acc * alpha[..., None] + pv


def _gather_chunk(pages, page_ids, valid=None):
    """K or V of a chunk: pages [Hkv, P, ps, D], page_ids [N, n] → [Hkv, N, n * ps, D].

    With `valid` [N, n * ps], rows outside it are zeroed (V must be: 0 * NaN is NaN; K need
    not be, its scores are masked with a select).
    """
    num_kv_heads, _, page_size, head_dim = pages.shape
    n_rows, n_pages = page_ids.shape
    x = pages[:, page_ids]  # [Hkv, N, n, ps, D]
    x = x.reshape(num_kv_heads, n_rows, n_pages * page_size, head_dim)
    if valid is None:
        return x
    return jnp.where(valid[None, :, :, None], x, jnp.zeros((), x.dtype))


def _gather_scales(scales, page_ids, valid=None):
    """Scales of a chunk: scales [Hkv, P, ps], page_ids [N, n] → f32[Hkv, N, n * ps]; zero
    outside `valid` [N, n * ps] (they multiply p, which is 0 there, and may be NaN)."""
    num_kv_heads = scales.shape[0]
    n_rows = page_ids.shape[0]
    x = scales[:, page_ids].reshape(num_kv_heads, n_rows, -1)  # [Hkv, N, n * ps]
    return x if valid is None else jnp.where(valid[None], x, 0.0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "kv_chunk_pages",
        "block_group",
    ),
)
def ragged_paged_attention_xla(
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
    block_q: int = 16,
    kv_chunk_pages: int = 8,
    block_group: int = 4,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    pool_layers: int = 1,  # (layers whose pages the pool holds: read by the Pallas cost only)
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention with work proportional to the live lengths (see module doc)."""
    quantized = check_scales(k_pages, v_pages, k_scales, v_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    kv_chunk_pages = min(kv_chunk_pages, pages_per_seq)
    chunk = kv_chunk_pages * page_size
    num_chunks_max = -(-pages_per_seq // kv_chunk_pages)
    # Pad the page table to whole chunks; padded columns are always masked.
    page_table = jnp.pad(
        page_indices, ((0, 0), (0, num_chunks_max * kv_chunk_pages - pages_per_seq))
    )
    cdtype = q.dtype

    live = jnp.arange(max_num_seqs) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    kv_lens = jnp.where(live, kv_lens, 0)

    def score(qs, ks, k_scale):  # qs [Hkv, N, R, D], ks [Hkv, N, C, D] -> [Hkv, N, R, C]
        if k_scale is not None:
            ks = ks.astype(cdtype)  # int8 / fp8 values are exact in bf16 and f32
        s = jnp.einsum(
            "hnrd,hncd->hnrc", qs, ks, preferred_element_type=jnp.float32, precision=FULL
        )
        if k_scale is not None:
            s = s * k_scale[:, :, None, :]
        s = s * sm_scale
        return soft_cap * jnp.tanh(s / soft_cap) if soft_cap is not None else s

    def chunk_scales(ids, valid):  # (k_scale, v_scale) f32[Hkv, N, C] of a chunk, or None
        if not quantized:
            return None, None
        return _gather_scales(k_scales, ids), _gather_scales(v_scales, ids, valid)

    def window_ok(kv_pos, q_pos):
        return True if sliding_window is None else kv_pos > q_pos - sliding_window

    out = jnp.zeros((num_tokens + 1, num_q_heads, head_dim), cdtype)  # row T: a sink

    # ---- decode path: one query row per sequence ------------------------------------------
    is_decode = q_lens == 1
    dec_rows = jnp.where(is_decode, cu_q_lens[:-1], num_tokens)  # [S]
    dec_pos = kv_lens - 1  # [S]
    q_dec = q[jnp.minimum(dec_rows, num_tokens - 1)]  # [S, Hq, D]
    q_dec = q_dec.reshape(max_num_seqs, num_kv_heads, group, head_dim).swapaxes(0, 1)
    # q_dec: [Hkv, S, G, D]
    dec_chunks = -(-jnp.max(jnp.where(is_decode, kv_lens, 0)) // chunk)

    def decode_body(c, carry):
        ids = lax.dynamic_slice_in_dim(page_table, c * kv_chunk_pages, kv_chunk_pages, axis=1)
        kv_pos = c * chunk + jnp.arange(chunk)  # [C]
        valid = (kv_pos[None, :] < kv_lens[:, None]) & window_ok(kv_pos[None, :], dec_pos[:, None])
        valid &= is_decode[:, None]  # [S, C]
        k = _gather_chunk(k_pages, ids)  # [Hkv, S, C, D]
        v = _gather_chunk(v_pages, ids, valid)
        k_scale, v_scale = chunk_scales(ids, valid)
        mask = valid[None, :, None, :]  # [1, S, 1, C]
        # One query row per sequence: too thin for a matmul, so multiply-and-reduce, which
        # XLA fuses with the gathers instead of materializing K and V.
        products = q_dec[:, :, :, None, :].astype(jnp.float32) * k[:, :, None].astype(jnp.float32)
        s = jnp.sum(products, axis=-1)  # [Hkv, S, G, C]
        if quantized:
            s = s * k_scale[:, :, None, :]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return _online_softmax_step(carry, s, mask, v, cdtype, as_matmul=False, v_scale=v_scale)

    init = (
        jnp.full((num_kv_heads, max_num_seqs, group), MASK_VALUE, jnp.float32),
        jnp.zeros((num_kv_heads, max_num_seqs, group), jnp.float32),
        jnp.zeros((num_kv_heads, max_num_seqs, group, head_dim), jnp.float32),
    )
    _, l_dec, acc_dec = lax.fori_loop(0, dec_chunks, decode_body, init)
    o_dec = acc_dec / jnp.where(l_dec == 0, 1.0, l_dec)[..., None]  # [Hkv, S, G, D]
    o_dec = o_dec.swapaxes(0, 1).reshape(max_num_seqs, num_q_heads, head_dim)
    out = out.at[dec_rows].set(o_dec.astype(cdtype))

    # ---- prefill path: blocks of block_q rows of one sequence -----------------------------
    is_prefill = q_lens > 1
    blocks_per_seq = jnp.where(is_prefill, -(-q_lens // block_q), 0)  # [S]
    cu_blocks = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks_per_seq)])
    num_blocks = cu_blocks[-1]
    # Static bound: the prefill rows fill at most T // block_q blocks plus one partial block
    # per prefill sequence (each has >= 2 rows, so there are at most T // 2 of them).
    max_blocks = num_tokens // block_q + min(max_num_seqs, num_tokens // 2)
    max_blocks = -(-max_blocks // block_group) * block_group
    if max_blocks == 0:  # a one-token batch: its row, if any, is on the decode path
        return out[:num_tokens]
    b = jnp.arange(max_blocks)
    blk_seq = jnp.clip(jnp.searchsorted(cu_blocks[1:], b, side="right"), 0, max_num_seqs - 1)
    blk_first = cu_q_lens[blk_seq] + (b - cu_blocks[blk_seq]) * block_q  # first row
    rows = blk_first[:, None] + jnp.arange(block_q)[None, :]  # [NB, B]
    row_ok = (rows < cu_q_lens[blk_seq + 1][:, None]) & (b < num_blocks)[:, None]
    row_pos = (
        kv_lens[blk_seq][:, None] - q_lens[blk_seq][:, None] + rows - cu_q_lens[blk_seq][:, None]
    )
    rows = jnp.where(row_ok, rows, num_tokens)  # sink row for padding
    # KV a block can see ends at its last row's position.
    blk_kv_end = jnp.where(row_ok, row_pos + 1, 0).max(axis=1)  # [NB]
    rows_per_block = block_q * group

    def group_body(g, out):
        sl = functools.partial(
            lax.dynamic_slice_in_dim, start_index=g * block_group, slice_size=block_group
        )
        g_seq, g_rows, g_ok, g_pos, g_end = (
            sl(blk_seq),
            sl(rows),
            sl(row_ok),
            sl(row_pos),
            sl(blk_kv_end),
        )
        g_pages = page_table[g_seq]  # [BG, pages]
        q_blk = q[jnp.minimum(g_rows, num_tokens - 1)]  # [BG, B, Hq, D]
        q_blk = q_blk.reshape(block_group, block_q, num_kv_heads, group, head_dim)
        q_blk = q_blk.transpose(2, 0, 1, 3, 4).reshape(
            num_kv_heads, block_group, rows_per_block, head_dim
        )  # [Hkv, BG, B*G, D]
        n_chunks = -(-jnp.max(g_end) // chunk)

        def chunk_body(c, carry):
            ids = lax.dynamic_slice_in_dim(g_pages, c * kv_chunk_pages, kv_chunk_pages, axis=1)
            kv_pos = c * chunk + jnp.arange(chunk)  # [C]
            kv_ok = kv_pos[None, :] < g_end[:, None]  # [BG, C]
            k = _gather_chunk(k_pages, ids)  # [Hkv, BG, C, D]
            v = _gather_chunk(v_pages, ids, kv_ok)
            k_scale, v_scale = chunk_scales(ids, kv_ok)
            mask = (kv_pos[None, None, :] <= g_pos[:, :, None]) & window_ok(
                kv_pos[None, None, :], g_pos[:, :, None]
            )
            mask &= g_ok[:, :, None] & kv_ok[:, None, :]  # [BG, B, C]
            mask = jnp.repeat(mask, group, axis=1)[None]  # [1, BG, B*G, C]
            scores = score(q_blk, k, k_scale)
            return _online_softmax_step(carry, scores, mask, v, cdtype, v_scale=v_scale)

        shape = (num_kv_heads, block_group, rows_per_block)
        init = (
            jnp.full(shape, MASK_VALUE, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        _, l_blk, acc = lax.fori_loop(0, n_chunks, chunk_body, init)
        o = acc / jnp.where(l_blk == 0, 1.0, l_blk)[..., None]  # [Hkv, BG, B*G, D]
        o = o.reshape(num_kv_heads, block_group, block_q, group, head_dim)
        o = o.transpose(1, 2, 0, 3, 4)  # [BG, B, Hkv, G, D]
        o = o.reshape(block_group * block_q, num_q_heads, head_dim).astype(cdtype)
        return out.at[g_rows.reshape(-1)].set(o)

    num_groups = -(-num_blocks // block_group)
    out = lax.fori_loop(0, num_groups, group_body, out)
    return out[:num_tokens]
