"""Plain-jnp ragged paged attention: the semantics every kernel is checked against.

A step packs the new query tokens of `num_seqs` sequences on one axis. Sequence `s` owns
query rows `cu_q_lens[s]:cu_q_lens[s + 1]`; these are the *last* `q_len` tokens of its
`kv_lens[s]` tokens, whose K/V (this step's included) live in the pages listed by
`page_indices[s]`. A query row at absolute position `p` attends to positions `0..p` of its
own sequence (and only `p - sliding_window < j` with a sliding window). Rows at or beyond
`cu_q_lens[num_seqs]` are padding: they read nothing and produce zeros.

The implementation gathers, for every query row, its sequence's pages. That costs
`T x pages_per_seq x page_size` K/V reads: fine as a reference and for small CPU batches.
Masked K/V values are zeroed before any arithmetic, so NaN in an unused page cannot leak.

Quantized pages (int8 / fp8, see kv_quant.py) come with `k_scales` / `v_scales`
`[num_kv_heads, num_pages, page_size]`: each gathered row is dequantized (value x its scale,
in float32) before it is masked and used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention.kv_quant import check_scales

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
#: The dots' precision: full float32 products for float32 operands (DEFAULT rounds them to
#: TF32 on NVIDIA GPUs; Triton's "ieee" input precision), a no-op for bf16 and 8-bit ones.
FULL = lax.Precision.HIGHEST


def token_metadata(
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: its sequence, its absolute position, and whether it is real.

    Returns `(seq_ids i32[T], q_positions i32[T], valid bool[T])`; rows that are padding get
    sequence 0 and position 0 and must be masked by the caller.
    """
    max_num_seqs = kv_lens.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    live_seq = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs[0]  # [S]
    ends = jnp.where(live_seq, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)  # [S]
    seq_ids = jnp.sum(ends[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)  # [T]
    valid = rows < cu_q_lens[num_seqs[0]]
    seq_ids = jnp.where(valid, seq_ids, 0)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    q_positions = kv_lens[seq_ids] - q_lens[seq_ids] + rows - cu_q_lens[seq_ids]
    q_positions = jnp.where(valid, q_positions, 0)
    return seq_ids, q_positions, valid


def ragged_paged_attention_reference(
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
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    pool_layers: int = 1,  # (layers whose pages the pool holds: read by the Pallas cost only)
) -> jax.Array:  # [T, num_q_heads, head_dim], dtype of q
    """Ragged paged attention in plain jnp (see the module docstring for the semantics)."""
    quantized = check_scales(k_pages, v_pages, k_scales, v_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    kv_width = pages_per_seq * page_size

    seq_ids, q_positions, valid = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    row_pages = page_indices[seq_ids]  # [T, pages_per_seq]

    kv_positions = jnp.arange(kv_width, dtype=jnp.int32)  # [L]
    mask = (kv_positions[None, :] < kv_lens[seq_ids][:, None]) & (
        kv_positions[None, :] <= q_positions[:, None]
    )  # [T, L]
    if sliding_window is not None:
        mask &= kv_positions[None, :] > q_positions[:, None] - sliding_window
    mask &= valid[:, None]

    def gather(pages: jax.Array, scales: jax.Array | None) -> jax.Array:
        x = pages[:, row_pages]  # [Hkv, T, pages_per_seq, page_size, D]
        x = x.reshape(num_kv_heads, num_tokens, kv_width, head_dim)  # [Hkv, T, L, D]
        if quantized:
            s = scales[:, row_pages].reshape(num_kv_heads, num_tokens, kv_width)  # [Hkv, T, L]
            x = x.astype(jnp.float32) * s[..., None]
        return jnp.where(mask[None, :, :, None], x, 0).astype(jnp.float32)

    k = gather(k_pages, k_scales)
    v = gather(v_pages, v_scales)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)  # [T,Hkv,G,D]
    scores = jnp.einsum("thgd,htld->thgl", qg, k, precision=FULL) * sm_scale  # [T, Hkv, G, L]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
    scores_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - scores_max)
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("thgl,htld->thgd", probs, v, precision=FULL)
    out = out / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
