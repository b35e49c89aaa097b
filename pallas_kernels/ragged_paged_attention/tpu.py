"""Ragged paged attention as a Mosaic TPU Pallas kernel.

Grid `(num_kv_heads, num_q_blocks)`, both parallel. One grid step owns one KV head and one
query block: `num_queries_per_block` tokens (possibly of several sequences) times the `G`
query heads of that KV head, packed as a `[rows, head_dim]` tile (see common.py). It walks,
in one flat loop, every (sequence, KV block) pair its rows need, and keeps an online softmax
per row, so the rows of each sequence only ever see their own sequence's keys.

Memory path:
- lengths and per-block sequence ranges are scalar-prefetched into SMEM (2 words per sequence
  plus 2 per query block);
- the page table stays in HBM, as given (2-D, no relayout): for each KV block, the aligned
  chunk of its sequence's table row that holds the block's page ids (`IDS_CHUNK` = 128 ids,
  or lcm(128, pages per block)) is copied into a 2-slot SMEM buffer one block ahead of the
  K/V copies that need it. SMEM use is thus fixed by the block size, whatever the pool
  size, `max_num_seqs` or `pages_per_seq` (TPU SMEM is 1 MiB on v5e; the whole-table
  prefetch this replaces overflowed it from 512 sequences x 1024 pages per sequence, e.g.
  16k-token contexts);
- K/V pages stay in HBM (`memory_space=pl.ANY`); each KV block is gathered page by page with
  async copies into a `[2, kv_block_tokens, head_dim]` VMEM scratch (double buffer: block
  i + 1 is in flight while block i is computed; the prefetch crosses sequence boundaries);
  pages past the causal end of the block's rows are neither copied nor waited on. The
  pipeline per KV block i: wait for the page ids of block i + 1 and start its K/V copies,
  start the page-id copy of block i + 2, wait for block i's K/V and compute;
- the DMA writes each page straight into its rows of a 2-D buffer, so the kernel computes on
  the buffer as is: no reshape of a DMA'd value, and only full-block stores (softmax state
  lives in VMEM scratch, masks are `jnp.where`). That is also what lets it run in TPU
  interpret mode on CPU, which is how CI checks it.

Quantized pages (int8 / fp8 with f32 `k_scales` / `v_scales` [Hkv, num_pages, page_size],
kv_quant.py): the K/V pages are DMA'd as stored (1 byte per value, half the HBM traffic of
bf16) and dequantized in VMEM, row by row: each KV block's tile becomes
`values.astype(f32) * scale` (one scale per token row), then q's dtype for the MXU. The
scales cannot be DMA'd per page: XLA's TPU layout of a float32 `[H, num_pages, page_size]`
array with page_size < 128 is `{1,2,0:T(8,128)}`, i.e. per head a `[page_size, num_pages]`
matrix with the pages on lanes (no lane padding), where one page's scales are one lane of
two tiles, and Mosaic DMAs slice lanes in whole 128-lane tiles only. So the kernel takes the
`[H, page_size, num_pages]` view (a bitcast of that layout, no copy), keeps one KV head's
scales in VMEM (a block per head, fetched once per head: `4 * page_size * num_pages` bytes
per array, the whole scale pool read once per call, 4 / head_dim of the int8 pool's bytes)
and picks each page's column out of its aligned 128-page chunk with a lane select and sum.
A page count that is a multiple of 128 saves the second pick of the narrower last chunk (and
lets write_kv scatter the scales in place: kv_write.scatter_scales_tpu). From page_size 128
up XLA stores the scales row-major and the view is a real transpose per call: correct, not
tuned for.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import tpu_kernel
from pallas_kernels.ragged_paged_attention.common import (
    pack_queries,
    query_block_seq_ranges,
    unpack_outputs,
)
from pallas_kernels.ragged_paged_attention.tpu_kernel import IDS_CHUNK, LANES
from pallas_kernels.ragged_paged_attention.tuning import default_block_sizes
from pallas_kernels.ragged_paged_attention.validate import static_validate_inputs


def cost_estimate(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    *,
    block_q: int,
    soft_cap: float | None,
    quantized: bool = False,
    pool_layers: int = 1,
) -> pl.CostEstimate:
    """What one call costs, for XLA's cost analysis (roofline and AOT reports).

    The real cost depends on the lengths, known only at run time, so this assumes the case
    the pool is sized for: a full pool, shared evenly by `min(T, S)` live sequences (each
    holding `min(pages_per_seq, num_pages / live)` pages of context) that split the `T`
    query tokens evenly. Every query row scores its sequence's whole context (an upper bound
    for causal prefill: about half of a chunk's own keys are masked), and each sequence's
    K/V is read once per query block it spans (once for decode; sliding windows are
    ignored). At the decode buckets that is "the live KV pool once", the term that bounds
    decode on bandwidth. A quantized pool adds its scales, all of them read once (they are
    fetched per KV head whole, see the module docstring). `pool_layers`: the pool stacks that
    many layers' pages; one layer's are counted.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_pages //= pool_layers
    max_num_seqs, pages_per_seq = page_indices.shape
    live = max(1, min(num_tokens, max_num_seqs))
    context = page_size * min(pages_per_seq, max(1, num_pages // live))  # keys per sequence
    q_blocks_per_seq = pl.cdiv(pl.cdiv(num_tokens, live), block_q)
    scores = num_tokens * num_q_heads * context  # score entries
    kv_bytes = 2 * num_kv_heads * live * context * q_blocks_per_seq * head_dim
    kv_bytes *= k_pages.dtype.itemsize
    table_bytes = live * pl.cdiv(context, page_size) * 4 * num_kv_heads
    if quantized:
        kv_bytes += 2 * num_kv_heads * num_pages * page_size * 4
    return pl.CostEstimate(
        flops=int(4 * scores * head_dim),  # q @ k and p @ v, 2 flops per multiply-add
        transcendentals=int(scores * (2 if soft_cap is not None else 1)),  # exp (and tanh)
        bytes_accessed=int(2 * q.size * q.dtype.itemsize + kv_bytes + table_bytes),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "vmem_limit_bytes",
        "interpret",
        "pool_layers",
    ),
)
def ragged_paged_attention_tpu(
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
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    pool_layers: int = 1,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention on TPU (Mosaic); semantics of `ragged_paged_attention_reference`.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs: as in the reference.
      sm_scale: score scale, usually head_dim ** -0.5.
      sliding_window: attend only to the last `sliding_window` positions (inclusive of self).
      soft_cap: scores become `soft_cap * tanh(scores / soft_cap)`.
      num_queries_per_block: query tokens per block (a multiple of 8 on TPU);
        None takes tuning.DEFAULT_BLOCK_SIZES["tpu"].
      num_kv_pages_per_block: pages per KV block (capped at pages_per_seq); None: the table.
      vmem_limit_bytes: Mosaic scoped VMEM limit; None keeps the compiler default.
      interpret: run in TPU interpret mode (CPU), as the tests do.
      k_scales, v_scales: f32 `[num_kv_heads, num_pages, page_size]`, required with int8 /
        fp8 pages (and only then): a stored row stands for its values times its scale. One
        KV head's scales sit in VMEM at a time (`4 * page_size * num_pages` bytes per array,
        single-buffered): a very large pool may need a larger `vmem_limit_bytes`.
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
    pages_per_seq = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    defaults = default_block_sizes("tpu", head_dim, page_size)
    block_q = num_queries_per_block or defaults.num_queries_per_block
    pages_per_block = min(num_kv_pages_per_block or defaults.num_kv_pages_per_block, pages_per_seq)
    if block_q <= 0 or pages_per_block <= 0:
        raise ValueError(f"{num_queries_per_block=} and {num_kv_pages_per_block=} must be positive")
    kv_block = pages_per_block * page_size
    rows = block_q * group
    num_q_blocks = pl.cdiv(num_tokens, block_q)
    ids_chunk = math.lcm(IDS_CHUNK, pages_per_block)
    chunks_per_seq = pl.cdiv(pages_per_seq, ids_chunk)

    packed_q = pack_queries(q, num_kv_heads, group, block_q)  # [Hkv, num_q_blocks * rows, D]
    first_seq, end_seq = query_block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks, block_q)
    # Whole chunks per table row, so every chunk copy is aligned and in bounds (the padding
    # ids are never used: pages past a sequence's length are not copied). A no-op, so no
    # copy of the table, when pages_per_seq is a multiple of 128 (2048+ tokens at page 16).
    table = jnp.pad(page_indices, ((0, 0), (0, chunks_per_seq * ids_chunk - pages_per_seq)))

    kernel = functools.partial(
        tpu_kernel.kernel,
        quantized=quantized,
        group=group,
        page_size=page_size,
        ids_chunk=ids_chunk,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    q_spec = pl.BlockSpec((pl.squeezed, rows, head_dim), lambda h, b, *_: (h, b, 0))
    in_specs = [
        q_spec,
        pl.BlockSpec(memory_space=pltpu.HBM),  # not VMEM, whatever its size
        pl.BlockSpec(memory_space=pl.ANY),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    scale_args, scale_scratch = (), []
    if quantized:
        # [H, page_size, num_pages]: a bitcast of XLA's TPU layout of [H, num_pages,
        # page_size] (pages on lanes); one head's block, refetched only when the head changes.
        scale_args = tuple(jnp.swapaxes(x, 1, 2) for x in (k_scales, v_scales))
        scale_spec = pl.BlockSpec(
            (pl.squeezed, page_size, num_pages),
            lambda h, b, *_: (h, 0, 0),
            pipeline_mode=pl.Buffered(1),
        )
        in_specs += [scale_spec, scale_spec]
        scale_scratch = [pltpu.SMEM((2, pages_per_block), jnp.int32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_kv_heads, num_q_blocks),
        in_specs=in_specs,
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((2, kv_block, head_dim), k_pages.dtype),
            pltpu.VMEM((2, kv_block, head_dim), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.SMEM((2, 1, ids_chunk), jnp.int32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, head_dim), jnp.float32),
            *scale_scratch,
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(packed_q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost_estimate(
            q,
            k_pages,
            page_indices,
            block_q=block_q,
            soft_cap=soft_cap,
            quantized=quantized,
            pool_layers=pool_layers,
        ),
        name="ragged_paged_attention_tpu",
    )(
        kv_lens,
        cu_q_lens,
        first_seq,
        end_seq,
        packed_q,
        table,  # 2-D as the caller holds it: no relayout
        k_pages,
        v_pages,
        *scale_args,
    )
    return unpack_outputs(out, num_tokens, num_q_heads, group)
