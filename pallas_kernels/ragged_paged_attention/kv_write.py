"""Write the K/V of a step's new tokens into their pages, for every attention backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def write_kv(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]: page * page_size + offset; PADDING_SLOT for padding
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V into the page pool; rows whose slot is out of range (PADDING_SLOT,
    negative, or past the pool) write nothing, as in the native CPU kernel.

    Under jit with the pages donated, XLA updates the pool in place. How the scatter indexes
    the pool depends on the platform the program is lowered for (`lax.platform_dependent`,
    so an ahead-of-time TPU compile on a CPU host gets the TPU form):
    - TPU: by (page, offset) on the 4-D pool. A flattened `[H, num_pages * page_size, D]`
      view does not fit TPU memory tiling (a page's `(page_size, head_dim)` tile), so XLA
      copied the whole pool into the flat layout and back every step (2 x pool bytes of HBM
      traffic per layer: 44.8 GB per chip per step for the Llama-3-8B preset on v5e).
    - elsewhere: along the flat slot axis, a bitcast on CPU and GPU; XLA's CPU scatter runs
      it 2-5x faster than the 4-D form (measured in docs/gpu-tpu.md).
    """
    num_slots = k_pages.shape[1] * k_pages.shape[2]
    in_range = (slot_mapping >= 0) & (slot_mapping < num_slots)
    # Every out-of-range row goes to slot `num_slots` (page `num_pages`): dropped by both.
    slot = jnp.where(in_range, slot_mapping, num_slots)
    scatter = functools.partial(lax.platform_dependent, tpu=scatter_by_page, default=scatter_flat)
    return scatter(k_pages, k, slot), scatter(v_pages, v, slot)


def scatter_by_page(
    pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    new: jax.Array,  # [T, num_kv_heads, head_dim]
    slot: jax.Array,  # i32[T]: in range, or num_pages * page_size to drop the row
) -> jax.Array:
    """`pages` with row t of `new` at (page, offset) = divmod(slot[t], page_size)."""
    page_size = pages.shape[2]
    rows = new.swapaxes(0, 1).astype(pages.dtype)  # [H, T, D]
    return pages.at[:, slot // page_size, slot % page_size].set(rows, mode="drop")


def scatter_flat(
    pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    new: jax.Array,  # [T, num_kv_heads, head_dim]
    slot: jax.Array,  # i32[T]: in range, or num_pages * page_size to drop the row
) -> jax.Array:
    """The same write through the `[H, num_pages * page_size, D]` view of the pool."""
    num_kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, head_dim)  # [H, slots, D]
    flat = flat.at[:, slot].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)
