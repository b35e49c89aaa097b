"""Ragged paged attention: reference, KV page layout, KV write path and Pallas kernels."""

from pallas_kernels.ragged_paged_attention.kv_write import write_kv
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.shapes import (
    PADDING_SLOT,
    kv_pages_bytes,
    kv_pages_shape,
    pages_per_seq,
)

__all__ = [
    "PADDING_SLOT",
    "kv_pages_bytes",
    "kv_pages_shape",
    "pages_per_seq",
    "ragged_paged_attention_reference",
    "write_kv",
]
