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
(f32) and log-sum-exp, and `gpu_kernel.combine_splits` (plain jnp, fused by XLA) merges them.
The rule that picks the factor from static shapes is `tuning.gpu_num_kv_splits`; the block
sizes come from `tuning.gpu_block_sizes` (a table checked for shared-memory fit).

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

The kernel body is in gpu_kernel.py; this module is the design, the block sizes, the grid,
the cost estimate and the jitted wrapper around the pallas_call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention import gpu_kernel
from pallas_kernels.ragged_paged_attention.common import (
    pack_queries,
    query_block_seq_ranges,
    unpack_outputs,
)
from pallas_kernels.ragged_paged_attention.tuning import (
    gpu_block_sizes,
    gpu_num_kv_splits,
    padded_head_dim,
)
from pallas_kernels.ragged_paged_attention.validate import static_validate_inputs


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
        "pool_layers",
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
    pool_layers: int = 1,
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
      num_kv_splits: split-KV factor (1: no split); partials merged by
        `gpu_kernel.combine_splits`.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in the Pallas interpreter (CPU), as the tests do.
      k_scales, v_scales: f32 `[num_kv_heads, num_pages, page_size]`, required with int8 /
        fp8 pages (and only then): a stored row stands for its values times its scale.
      pool_layers: the pool holds that many layers' pages (stacked over the layers): the cost
        estimate counts one layer's (`num_pages / pool_layers`).

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
        gpu_kernel.kernel,
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
        num_pages=num_pages // pool_layers,  # (a pool stacked over the layers: one layer's)
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
        out = gpu_kernel.combine_splits(*out).astype(q.dtype)  # [Hkv, T_pad * Gp, Dp]
    return unpack_outputs(out[..., :head_dim], num_tokens, num_q_heads, padded_group)
