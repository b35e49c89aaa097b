"""The kernels lower for real hardware on this CPU-only machine, so CI catches a kernel that
only runs in interpret mode.

`jax.jit(f).trace(*abstract_args).lower(lowering_platforms=(platform,))` runs the Pallas
lowering for a platform with no device of that kind attached:

- "cuda": Pallas lowers the kernel body to Triton IR (`tt` dialect) and emits a
  `stablehlo.custom_call @__gpu$xla.gpu.triton` whose `backend_config.ir` is that module as
  MLIR bytecode. The test parses the bytecode back with the Triton dialect bundled in jaxlib
  and runs the MLIR verifier. That proves every op has a Triton lowering (power-of-two tile
  sizes, 2-D dot operands of one element type, supported gathers and masked loads, loops) and
  that the module is well-formed Triton IR. It does not run Triton's own compiler passes
  (layouts, shared-memory budget, PTX): XLA's GPU compiler does that, at compile time, which
  needs a CUDA jaxlib plugin and a GPU.
- "tpu": Pallas lowers the kernel to a Mosaic MLIR function (verified during lowering) inside
  a `tpu_custom_call`. Not covered: Mosaic's layout passes and the real compile in libtpu.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jaxlib.mlir import ir
from jaxlib.triton import dialect as triton_dialect
from rpa_cases import Shape, abstract_args, abstract_scales

from pallas_kernels.ragged_paged_attention import (
    gpu_block_sizes,
    gpu_num_kv_splits,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
)

CASES = {
    "f32_hd64_g1": Shape(num_q_heads=2, num_kv_heads=2, head_dim=64),
    "bf16_hd128_g8": Shape(num_q_heads=8, num_kv_heads=1, head_dim=128, dtype="bfloat16"),
    "bf16_hd128_g3": Shape(num_q_heads=6, num_kv_heads=2, head_dim=128, dtype="bfloat16"),
    "bf16_hd128_ps32": Shape(head_dim=128, page_size=32, pages_per_seq=8, dtype="bfloat16"),
}
#: The GPU kernel also pads head_dim (80, 96: Phi-2, Phi-3) and splits KV (a decode bucket
#: whose longest context spans many KV blocks: the rule picks several splits).
GPU_CASES = CASES | {
    "bf16_hd96_g1": Shape(num_q_heads=4, num_kv_heads=4, head_dim=96, dtype="bfloat16"),
    "bf16_hd80_split": Shape(
        num_tokens=4, head_dim=80, num_pages=256, pages_per_seq=64, dtype="bfloat16"
    ),
}


def expected_blocks(shape: Shape):
    """What the wrapper picks: the tuning table, and the split rule for those blocks."""
    blocks = gpu_block_sizes(
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        num_tokens=shape.num_tokens,
        max_num_seqs=shape.max_num_seqs,
        pages_per_seq=shape.pages_per_seq,
        itemsize=jnp.dtype(shape.dtype).itemsize,
    )
    padded_group = 1 << (shape.num_q_heads // shape.num_kv_heads - 1).bit_length()
    block_q = max(blocks.num_queries_per_block, 16 // min(padded_group, 16))
    splits = gpu_num_kv_splits(
        num_q_blocks=-(-shape.num_tokens // block_q),
        num_kv_heads=shape.num_kv_heads,
        max_kv_blocks=-(-shape.pages_per_seq // blocks.num_kv_pages_per_block),
    )
    return blocks, splits


def custom_calls(module: ir.Module) -> list[ir.Operation]:
    found = []

    def visit(op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        found.append(child.operation)
                    visit(child.operation)

    visit(module.operation)
    return found


def lower(kernel, shape: Shape, platform: str, kv_dtype=None, **kwargs) -> ir.Module:
    fn = functools.partial(kernel, sm_scale=shape.head_dim**-0.5, **kwargs)
    scales = abstract_scales(shape) if kv_dtype else {}
    traced = jax.jit(fn).trace(*abstract_args(shape, kv_dtype=kv_dtype), **scales)
    return traced.lower(lowering_platforms=(platform,)).compiler_ir("stablehlo")


@pytest.mark.parametrize("window_and_cap", [(None, None), (128, 30.0)], ids=str)
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_kernel_lowers_to_valid_triton_ir(case, window_and_cap):
    shape = GPU_CASES[case]
    sliding_window, soft_cap = window_and_cap
    module = lower(
        ragged_paged_attention_gpu,
        shape,
        "cuda",
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    (call,) = custom_calls(module)
    assert ir.StringAttr(call.attributes["call_target_name"]).value == "__gpu$xla.gpu.triton"
    config = call.attributes["mhlo.backend_config"]
    blocks, splits = expected_blocks(shape)
    assert ir.IntegerAttr(config["num_warps"]).value == blocks.num_warps
    assert ir.IntegerAttr(config["num_stages"]).value == blocks.num_stages
    assert ir.IntegerAttr(config["grid_z"]).value == splits
    assert (splits > 1) == case.endswith("_split")
    assert ir.StringAttr(config["name"]).value == "ragged_paged_attention_gpu"

    context = ir.Context()
    triton_dialect.register_dialect(context)
    context.load_all_available_dialects()
    triton_module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=context)
    assert triton_module.operation.verify()
    text = str(triton_module)
    assert text.count("tt.dot ") == 2  # q @ k.T and p @ v, once per KV block
    assert "tt.load" in text and "tt.store" in text


@pytest.mark.parametrize("case", sorted(CASES))
def test_tpu_kernel_lowers_to_mosaic(case):
    shape = CASES[case]
    module = lower(ragged_paged_attention_tpu, shape, "tpu", sliding_window=64, soft_cap=30.0)
    targets = [ir.StringAttr(c.attributes["call_target_name"]).value for c in custom_calls(module)]
    assert targets == ["tpu_custom_call"]


QUANTIZED_CASES = {
    "int8_hd128_g8": ("int8", Shape(num_q_heads=8, num_kv_heads=1, head_dim=128, dtype="bfloat16")),
    "fp8_e4m3_hd64_g1": ("fp8_e4m3", Shape(num_q_heads=2, num_kv_heads=2, head_dim=64)),
    "fp8_e5m2_hd96_split": (
        "fp8_e5m2",
        Shape(num_tokens=4, head_dim=96, num_pages=256, pages_per_seq=64, dtype="bfloat16"),
    ),
}


@pytest.mark.parametrize("case", sorted(QUANTIZED_CASES))
def test_quantized_gpu_kernel_lowers_to_valid_triton_ir(case):
    """1-byte K/V tiles loaded as stored, converted to q's dtype: still two dots of one
    element type per KV block, plus the two scale loads."""
    kv_dtype, shape = QUANTIZED_CASES[case]
    module = lower(ragged_paged_attention_gpu, shape, "cuda", kv_dtype=kv_dtype)
    (call,) = custom_calls(module)
    config = call.attributes["mhlo.backend_config"]
    context = ir.Context()
    triton_dialect.register_dialect(context)
    context.load_all_available_dialects()
    triton_module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=context)
    assert triton_module.operation.verify()
    text = str(triton_module)
    assert text.count("tt.dot ") == 2
    element = {"int8": "i8", "fp8_e4m3": "f8E4M3FN", "fp8_e5m2": "f8E5M2"}[kv_dtype]
    assert f"x{element}>" in text  # the pages are read as stored


@pytest.mark.parametrize("case", sorted(QUANTIZED_CASES))
def test_quantized_tpu_kernel_lowers_to_mosaic(case):
    kv_dtype, shape = QUANTIZED_CASES[case]
    module = lower(ragged_paged_attention_tpu, shape, "tpu", kv_dtype=kv_dtype, soft_cap=30.0)
    targets = [ir.StringAttr(c.attributes["call_target_name"]).value for c in custom_calls(module)]
    assert targets == ["tpu_custom_call"]
