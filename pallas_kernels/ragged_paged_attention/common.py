"""Pieces shared by the TPU and GPU kernels: query packing and per-block sequence ranges.

Both kernels work on one KV head at a time and stack the `G` query heads that share it under
the query tokens, so one K/V block load serves all of them and a query block is a plain 2-D
`[rows, head_dim]` tile (row `t * G + g` is token `t`, head `g` of the group):

    q [T, Hq, D] -> [Hkv, T, G, D] -> pad T to a block multiple -> [Hkv, T_pad * G, D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Finite "minus infinity": exp(MASK_VALUE - m) underflows to 0 without inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def pack_queries(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    num_kv_heads: int,
    padded_group: int,
    num_queries_per_block: int,
) -> jax.Array:  # [num_kv_heads, T_pad * padded_group, head_dim]
    """Group the query heads of each KV head under the tokens, zero-padding T and G."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    padded_tokens = -(-num_tokens // num_queries_per_block) * num_queries_per_block
    x = q.reshape(num_tokens, num_kv_heads, group, head_dim).swapaxes(0, 1)  # [Hkv, T, G, D]
    x = jnp.pad(x, ((0, 0), (0, padded_tokens - num_tokens), (0, padded_group - group), (0, 0)))
    return x.reshape(num_kv_heads, padded_tokens * padded_group, head_dim)  # [Hkv, T_pad*Gp, D]


def unpack_outputs(
    out: jax.Array,  # [num_kv_heads, T_pad * padded_group, head_dim]
    num_tokens: int,
    num_q_heads: int,
    padded_group: int,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Inverse of `pack_queries`: drop the padding tokens and heads."""
    num_kv_heads, _, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    x = out.reshape(num_kv_heads, -1, padded_group, head_dim)  # [Hkv, T_pad, Gp, D]
    x = x[:, :num_tokens, :group]  # [Hkv, T, G, D]
    return x.swapaxes(0, 1).reshape(num_tokens, num_q_heads, head_dim)


def query_block_seq_ranges(
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    num_q_blocks: int,
    num_queries_per_block: int,
) -> tuple[jax.Array, jax.Array]:  # (i32[num_q_blocks], i32[num_q_blocks])
    """Per query block, the half-open range of live sequences that own rows in it.

    Sequence `s` may own rows of block `b` iff `cu_q_lens[s] < (b + 1) * bq` and
    `cu_q_lens[s + 1] > b * bq`; sequences in the range with no rows there (q_len 0) are
    skipped by the kernels. Blocks past the last real row get an empty range.
    """
    max_num_seqs = cu_q_lens.shape[0] - 1
    live = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs[0]  # [S]
    starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * num_queries_per_block  # [B]
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)  # [S]
    begins = jnp.where(live, cu_q_lens[:-1], jnp.iinfo(jnp.int32).max)  # [S]
    first = jnp.sum(ends[None, :] <= starts[:, None], axis=1, dtype=jnp.int32)  # [B]
    stops = starts + num_queries_per_block  # [B]
    last = jnp.sum(begins[None, :] < stops[:, None], axis=1, dtype=jnp.int32)  # [B]
    return first, jnp.maximum(first, last)
