"""Write the K/V of a step's new tokens into their pages, for every attention backend."""

from __future__ import annotations

import jax


def write_kv(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]: page * page_size + offset; PADDING_SLOT for padding
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V into the page pool; padding rows (out-of-range slots) write nothing.

    Under jit with the pages donated, XLA updates the pool in place.
    """
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(num_kv_heads, num_pages * page_size, head_dim)  # [H, slots, D]
        flat = flat.at[:, slot_mapping].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)
