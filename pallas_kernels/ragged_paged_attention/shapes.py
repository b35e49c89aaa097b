"""The one definition of the KV page layout shared by every attention backend.

Each layer owns two arrays, K pages and V pages, both shaped

    [num_kv_heads, num_pages, page_size, head_dim]

Why this layout:
- head-major: the `page_size x head_dim` tile of one head in one page is contiguous, so a
  kernel that works on one KV head (GPU grid axis, TPU DMA) loads a page with one
  contiguous copy;
- tensor parallelism shards KV heads, and axis 0 is the head axis, so each device holds a
  dense slice of the pool;
- K and V apart keep the write path a plain scatter along the flattened
  `num_pages * page_size` slot axis and let each backend read only what it needs.
"""

from __future__ import annotations

import numpy as np

#: Slot index used for padding tokens in the slot mapping. It is out of range for any pool,
#: so a scatter with `mode="drop"` writes nothing for them.
PADDING_SLOT = np.iinfo(np.int32).max


def kv_pages_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) page array."""
    return (num_kv_heads, num_pages, page_size, head_dim)


def kv_pages_bytes(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes taken by one layer's K and V page arrays together."""
    return 2 * num_kv_heads * num_pages * page_size * head_dim * itemsize


def kv_scales_shape(num_pages: int, page_size: int, num_kv_heads: int) -> tuple[int, int, int]:
    """Shape of one layer's K (or V) scale array of a quantized pool (kv_quant.py): one
    float32 per (KV head, page, slot)."""
    return (num_kv_heads, num_pages, page_size)


def kv_scales_bytes(num_pages: int, page_size: int, num_kv_heads: int) -> int:
    """Bytes taken by one layer's K and V scale arrays together (float32) of a quantized pool."""
    return 2 * num_kv_heads * num_pages * page_size * 4


def pages_per_seq(max_model_len: int, page_size: int) -> int:
    """Width of a page table row: pages needed by the longest allowed sequence."""
    return -(-max_model_len // page_size)
