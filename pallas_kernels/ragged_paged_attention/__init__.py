"""Ragged paged attention: reference, KV page layout, KV write path and Pallas kernels."""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.kv_quant import (
    QMAX,
    QUANTIZED_KV_DTYPES,
    dequantize,
    is_quantized_kv,
    quantize_rows,
)
from pallas_kernels.ragged_paged_attention.kv_write import write_kv
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.shapes import (
    PADDING_SLOT,
    kv_pages_bytes,
    kv_pages_shape,
    kv_scales_bytes,
    kv_scales_shape,
    pages_per_seq,
)
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.tuning import (
    DEFAULT_BLOCK_SIZES,
    GPU_TILES,
    BlockSizes,
    default_block_sizes,
    gpu_block_sizes,
    gpu_num_kv_splits,
    gpu_shared_memory_bytes,
)
from pallas_kernels.ragged_paged_attention.validate import (
    dynamic_validate_inputs,
    static_validate_inputs,
)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    backend: Literal["tpu", "gpu"],
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    pool_layers: int = 1,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Run the Pallas kernel of `backend`; same semantics as `ragged_paged_attention_reference`.

    `pool_layers`: the pool holds that many layers' pages (a pool stacked over the layers,
    each layer's pages a slice of it): the kernels' cost estimates count one layer's.

    Quantized pages (int8, float8_e4m3fn, float8_e5m2) take their `k_scales` / `v_scales`
    (kv_quant.py); both kernels read the pages as stored and dequantize on chip.

    Block sizes left as None come from `DEFAULT_BLOCK_SIZES["tpu"][(head_dim, page_size)]` on
    TPU and from `gpu_block_sizes` (a table per head_dim and batch shape) on GPU.
    Backend-only knobs (TPU `vmem_limit_bytes`, GPU `num_warps`/`num_stages`/`num_kv_splits`)
    are reached by calling `ragged_paged_attention_tpu` / `ragged_paged_attention_gpu` directly.
    """
    kernels = {"tpu": ragged_paged_attention_tpu, "gpu": ragged_paged_attention_gpu}
    if backend not in kernels:
        raise ValueError(f"{backend=} must be one of {sorted(kernels)}")
    return kernels[backend](
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
        interpret=interpret,
        k_scales=k_scales,
        v_scales=v_scales,
        pool_layers=pool_layers,
    )


__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "GPU_TILES",
    "PADDING_SLOT",
    "QMAX",
    "QUANTIZED_KV_DTYPES",
    "BlockSizes",
    "default_block_sizes",
    "dequantize",
    "dynamic_validate_inputs",
    "gpu_block_sizes",
    "gpu_num_kv_splits",
    "gpu_shared_memory_bytes",
    "is_quantized_kv",
    "kv_pages_bytes",
    "kv_pages_shape",
    "kv_scales_bytes",
    "kv_scales_shape",
    "pages_per_seq",
    "quantize_rows",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "static_validate_inputs",
    "write_kv",
]
