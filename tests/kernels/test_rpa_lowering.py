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
from rpa_cases import Shape

from pallas_kernels.ragged_paged_attention import (
    default_block_sizes,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
)

CASES = {
    "f32_hd64_g1": Shape(num_q_heads=2, num_kv_heads=2, head_dim=64),
    "bf16_hd128_g8": Shape(num_q_heads=8, num_kv_heads=1, head_dim=128, dtype="bfloat16"),
    "bf16_hd128_g3": Shape(num_q_heads=6, num_kv_heads=2, head_dim=128, dtype="bfloat16"),
    "bf16_hd128_ps32": Shape(head_dim=128, page_size=32, pages_per_seq=8, dtype="bfloat16"),
}


def abstract_args(shape: Shape) -> list[jax.ShapeDtypeStruct]:
    s = shape.max_num_seqs
    kv = (shape.num_kv_heads, shape.num_pages, shape.page_size, shape.head_dim)
    return [
        jax.ShapeDtypeStruct((shape.num_tokens, shape.num_q_heads, shape.head_dim), shape.dtype),
        jax.ShapeDtypeStruct(kv, shape.dtype),
        jax.ShapeDtypeStruct(kv, shape.dtype),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, shape.pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    ]


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


def lower(kernel, shape: Shape, platform: str, **kwargs) -> ir.Module:
    fn = functools.partial(kernel, sm_scale=shape.head_dim**-0.5, **kwargs)
    traced = jax.jit(fn).trace(*abstract_args(shape))
    return traced.lower(lowering_platforms=(platform,)).compiler_ir("stablehlo")


@pytest.mark.parametrize("window_and_cap", [(None, None), (128, 30.0)], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_kernel_lowers_to_valid_triton_ir(case, window_and_cap):
    shape = CASES[case]
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
    defaults = default_block_sizes("gpu", shape.head_dim, shape.page_size)
    assert ir.IntegerAttr(config["num_warps"]).value == defaults.num_warps
    assert ir.IntegerAttr(config["num_stages"]).value == defaults.num_stages
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
