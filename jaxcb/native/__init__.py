"""jaxcb's native CPU kernels (C++ through XLA FFI): ragged paged attention, the in-place KV
write, and matmuls over weights packed once at load time (AMX, AVX512-BF16, AVX-512 f32).

    build.py   compile the sources (attention.cc, matmul.cc, common.h) on first use into one
               library in the jaxcb cache directory, load it, register its FFI targets, and
               say which kernels this CPU can run
    ops.py     the kernels as jax functions, the weight packing, the PACKED_MATMULS table

This package imports nothing from jaxcb but the cache directory (jaxcb.paths): the attention
choice and the model code call into it, never the other way round.
"""

from jaxcb.native.build import (
    NativeBuildError,
    amx_available,
    argmax_screen_available,
    available,
    avx512_available,
    avx512_bf16_available,
)
from jaxcb.native.ops import (
    ARGMAX_SLOTS,
    PACKED_MATMULS,
    PackedMatmul,
    can_pack_bf16,
    can_pack_f32,
    matmul_amx,
    matmul_argmax_avx512_bf16,
    matmul_argmax_avx512_f32,
    matmul_argmax_screened_f32,
    matmul_avx512_bf16,
    matmul_avx512_f32,
    pack_argmax_screen,
    pack_bf16,
    pack_f32,
    ragged_paged_attention_native,
    swiglu_avx512_bf16,
    swiglu_avx512_f32,
    write_kv_native,
)

__all__ = [
    "ARGMAX_SLOTS",
    "PACKED_MATMULS",
    "NativeBuildError",
    "PackedMatmul",
    "amx_available",
    "argmax_screen_available",
    "available",
    "avx512_available",
    "avx512_bf16_available",
    "can_pack_bf16",
    "can_pack_f32",
    "matmul_amx",
    "matmul_argmax_avx512_bf16",
    "matmul_argmax_avx512_f32",
    "matmul_argmax_screened_f32",
    "matmul_avx512_bf16",
    "matmul_avx512_f32",
    "pack_argmax_screen",
    "pack_bf16",
    "pack_f32",
    "ragged_paged_attention_native",
    "swiglu_avx512_bf16",
    "swiglu_avx512_f32",
    "write_kv_native",
]
