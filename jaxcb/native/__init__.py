"""jaxcb's native CPU kernels (C++ through XLA FFI): ragged paged attention, the in-place KV
write, and matmuls over weights packed once at load time (AMX, AVX512-BF16, AVX-512 and AVX2,
float32, bfloat16 and int8), compiled per ISA level and chosen by what the CPU has.

    build.py      the ISA levels, what this CPU fits (capped by JAXCB_CPU_ISA), compiling the
                  sources (attention.cc, matmul.cc, lora.cc, read_probe.cc over common.h,
                  simd.h) once per level into the jaxcb cache directory, loading a level's
                  library and registering its FFI targets; the memory's read bandwidth
                  (read_probe.cc), which the single-stream benchmark states its rates
                  against
    packing.py    the weight layouts the matmul kernels read (numpy, at load time)
    attention.py  the attention kernels as jax functions: ragged paged attention, KV write
    matmul.py     the matmul kernels as jax functions, the PACKED_MATMULS table
    normed.py     the quantized matmuls with the RMS norm before them in the same call
    grouped.py    the grouped matmuls of a mixture of experts over stacks of packed weights
    lora.py       LoRA adapters' term (lora.cc): each row through its own slot, in place

This package imports nothing from jaxcb but the cache directory (jaxcb.paths): the attention
choice and the model code call into it, never the other way round.
"""

from jaxcb.native.attention import (
    copy_kv_native,
    ragged_paged_attention_native,
    write_kv_native,
)
from jaxcb.native.build import (
    ISA_ENV,
    ISA_LEVELS,
    TILE_SHAPES,
    NativeBuildError,
    active_level,
    available,
    cpu_flags,
    cpu_model,
    cpu_summary,
    force_tile_shape,
    read_bandwidth,
    supported_levels,
    tile_shapes,
)
from jaxcb.native.grouped import (
    GROUPED_TARGETS,
    can_pack_experts,
    pack_experts,
    packed_grouped_matmul,
    packed_grouped_swiglu,
)
from jaxcb.native.lora import can_add_lora, lora_add
from jaxcb.native.matmul import (
    ALL_PACKED,
    ARGMAX_SLOTS,
    INT4_MATMUL,
    INT8_MATMUL,
    PACKED_MATMULS,
    PackedMatmul,
    matmul_argmax_screened_f32,
    packed_matmul,
    packed_matmul_argmax,
    packed_swiglu,
)
from jaxcb.native.normed import NORM_TARGETS, packed_norm_matmul
from jaxcb.native.packing import (
    can_pack_bf16,
    can_pack_f32,
    can_pack_int8,
    fits_int4,
    is_symmetric,
    pack_argmax_screen,
    pack_bf16,
    pack_f32,
    pack_int4,
    pack_int8,
)

__all__ = [
    "ALL_PACKED",
    "ARGMAX_SLOTS",
    "GROUPED_TARGETS",
    "INT4_MATMUL",
    "INT8_MATMUL",
    "ISA_ENV",
    "ISA_LEVELS",
    "NORM_TARGETS",
    "PACKED_MATMULS",
    "TILE_SHAPES",
    "NativeBuildError",
    "PackedMatmul",
    "active_level",
    "available",
    "can_add_lora",
    "can_pack_bf16",
    "can_pack_experts",
    "can_pack_f32",
    "can_pack_int8",
    "copy_kv_native",
    "cpu_flags",
    "cpu_model",
    "cpu_summary",
    "fits_int4",
    "force_tile_shape",
    "is_symmetric",
    "lora_add",
    "matmul_argmax_screened_f32",
    "pack_argmax_screen",
    "pack_bf16",
    "pack_experts",
    "pack_f32",
    "pack_int4",
    "pack_int8",
    "packed_grouped_matmul",
    "packed_grouped_swiglu",
    "packed_matmul",
    "packed_matmul_argmax",
    "packed_norm_matmul",
    "packed_swiglu",
    "ragged_paged_attention_native",
    "read_bandwidth",
    "supported_levels",
    "tile_shapes",
    "write_kv_native",
]
