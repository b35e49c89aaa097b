"""Write the K/V of a step's new tokens into their pages, for every attention backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention.kv_quant import check_scales, quantize_rows


def write_kv(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]: page * page_size + offset; PADDING_SLOT for padding
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
) -> tuple[jax.Array, ...]:
    """Scatter new K/V into the page pool; rows whose slot is out of range (PADDING_SLOT,
    negative, or past the pool) write nothing, as in the native CPU kernel.

    Quantized pool (int8 / fp8 pages, `k_scales` and `v_scales` given): each new token-head
    row is quantized with its own scale (`kv_quant.quantize_rows`) and its values and scale
    are scattered alike; returns `(k_pages, v_pages, k_scales, v_scales)`. Float pool (no
    scales): returns `(k_pages, v_pages)`, the rows cast to the pages' dtype.

    Under jit with the pages donated, XLA updates the pool in place. How the scatter indexes
    the pool depends on the platform the program is lowered for (`lax.platform_dependent`,
    so an ahead-of-time TPU compile on a CPU host gets the TPU form):
    - TPU: one row of head_dim per (head, token), by (head, page, offset) on the 4-D pool
      (`scatter_by_page`). A flattened `[H, num_pages * page_size, D]` view does not fit TPU
      memory tiling (a page's `(page_size, head_dim)` tile), so XLA copied the whole pool
      into the flat layout and back every step (2 x pool bytes of HBM traffic per layer:
      44.8 GB per chip per step for the Llama-3-8B preset on v5e).
    - elsewhere: along the flat slot axis, a bitcast on CPU and GPU; XLA's CPU scatter runs
      it 2-5x faster than the 4-D form (measured in docs/gpu-tpu.md).
    The scales of a quantized pool take the flat form off TPU too; on TPU see
    `scatter_scales_tpu`.
    """
    quantized = check_scales(k_pages, v_pages, k_scales, v_scales)
    num_slots = k_pages.shape[1] * k_pages.shape[2]
    in_range = (slot_mapping >= 0) & (slot_mapping < num_slots)
    # Every out-of-range row goes to slot `num_slots` (page `num_pages`): dropped by both.
    slot = jnp.where(in_range, slot_mapping, num_slots)
    scatter = functools.partial(lax.platform_dependent, tpu=scatter_by_page, default=scatter_flat)
    if not quantized:
        return scatter(k_pages, k, slot), scatter(v_pages, v, slot)
    k_values, k_new_scales = quantize_rows(k, k_pages.dtype)  # [T, H, D], f32[T, H]
    v_values, v_new_scales = quantize_rows(v, v_pages.dtype)
    scatter_scales = functools.partial(
        lax.platform_dependent, tpu=scatter_scales_tpu, default=scatter_flat
    )
    return (
        scatter(k_pages, k_values, slot),
        scatter(v_pages, v_values, slot),
        scatter_scales(k_scales, k_new_scales, slot),
        scatter_scales(v_scales, v_new_scales, slot),
    )


def scatter_by_page(
    pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim] (or scales: no D)
    new: jax.Array,  # [T, num_kv_heads, head_dim] (or [T, num_kv_heads])
    slot: jax.Array,  # i32[T]: in range, or num_pages * page_size to drop the row
) -> jax.Array:
    """`pages` with row t of `new` at (page, offset) = divmod(slot[t], page_size).

    Each (head, token) is its own update of one head_dim row, indexed by (head, page,
    offset), so the scatter's window is the pool's minor dimension alone. A window of every
    head's row at once (`pages.at[:, page, offset]`) has XLA's TPU layout assignment keep the
    pool with the heads next to head_dim (`{3,0,2,1}`) wherever it is free to choose: in a
    scan over the layers' stacked pool it did, and copied the whole pool into and out of that
    layout around every layer's write (the Mosaic kernel reads the row-major pool): 4.8 GB of
    temporaries and ~400 GB a step for the Qwen3-8B preset on v5e x4 at (64, 16)."""
    page_size = pages.shape[2]
    rows = new.swapaxes(0, 1).astype(pages.dtype)  # [H, T, D] (or [H, T])
    heads = jnp.arange(pages.shape[0], dtype=jnp.int32)[:, None]  # [H, 1]
    page, offset = (slot // page_size)[None], (slot % page_size)[None]  # [1, T]
    return pages.at[heads, page, offset].set(rows, mode="drop")


def scatter_flat(
    pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim] (or scales: no D)
    new: jax.Array,  # [T, num_kv_heads, head_dim] (or [T, num_kv_heads])
    slot: jax.Array,  # i32[T]: in range, or num_pages * page_size to drop the row
) -> jax.Array:
    """The same write through the `[H, num_pages * page_size, D]` view of the pool."""
    num_kv_heads, num_pages, page_size, *rest = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, *rest)  # [H, slots, D]
    flat = flat.at[:, slot].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


#: TPU memory tile of a 32-bit array: (sublanes, lanes).
_TPU_TILE = (8, 128)


def scatter_scales_tpu(
    scales: jax.Array,  # f32[num_kv_heads, num_pages, page_size]
    new: jax.Array,  # f32[T, num_kv_heads]
    slot: jax.Array,  # i32[T]: in range, or num_pages * page_size to drop the row
) -> jax.Array:
    """The scale write on TPU: one element per (head, token), through a 1-D view of the
    scales in their memory order, which XLA scatters in place.

    XLA's TPU layout of f32 `[H, P, page_size]` is `{1,2,0:T(8,128)}` for page_size < 128
    (per head a `[page_size, P]` matrix of (8, 128) tiles: pages on lanes, no padding) and
    row-major `{2,1,0:T(8,128)}` from 128 up. Neither form is scattered in place one element
    at a time: the (page, offset) scatter made XLA relayout both scale arrays through VMEM
    at every write (6 copies of the scale pool per layer in the compiled step). The 1-D view
    that lists the elements in memory order (heads, tile rows, tile columns, then within the
    tile) is a bitcast of either layout when the tiles are whole (`page_size % 8 == 0` and
    `num_pages % 128 == 0`, resp. `page_size % 128 == 0` and `num_pages % 8 == 0`), and XLA
    scatters a 1-D array in place. Other pools take `scatter_by_page` (in place since it
    writes one element per (head, token) update, but XLA counts ~6x the bytes for a layer:
    test_rpa_tpu_compile.py): a quantized pool on TPU should have a page count that is a
    multiple of 128.
    """
    num_kv_heads, num_pages, page_size = scales.shape
    sublanes, lanes = _TPU_TILE
    page, offset = slot // page_size, slot % page_size
    transposed = page_size < lanes
    if transposed and page_size % sublanes == 0 and num_pages % lanes == 0:
        # [H, page_size, P] row-major: rows = offsets, columns = pages.
        view = jnp.swapaxes(scales, 1, 2)
        row, column = offset, page
        num_rows, num_columns = page_size, num_pages
    elif not transposed and page_size % lanes == 0 and num_pages % sublanes == 0:
        view, row, column = scales, page, offset  # [H, P, page_size] row-major
        num_rows, num_columns = num_pages, page_size
    else:
        return scatter_by_page(scales, new, slot)
    tiles = (num_kv_heads, num_rows // sublanes, sublanes, num_columns // lanes, lanes)
    flat = view.reshape(tiles).transpose(0, 1, 3, 2, 4).reshape(-1)  # memory order
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None]  # [H, 1]
    tile = (heads * (num_rows // sublanes) + row // sublanes) * (num_columns // lanes)
    index = ((tile + column // lanes) * sublanes + row % sublanes) * lanes + column % lanes
    index = jnp.where(slot < num_pages * page_size, index, flat.size)  # [H, T]; drop: size
    flat = flat.at[index.reshape(-1)].set(new.T.reshape(-1).astype(scales.dtype), mode="drop")
    view = flat.reshape(tiles[0], tiles[1], tiles[3], tiles[2], tiles[4]).transpose(0, 1, 3, 2, 4)
    view = view.reshape(num_kv_heads, num_rows, num_columns)
    return jnp.swapaxes(view, 1, 2) if transposed else view
