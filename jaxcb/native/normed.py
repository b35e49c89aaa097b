"""The packed matmuls with the RMS norm before them in the same call.

A decode step of a small model is a few hundred ops, and XLA's CPU runtime spends a few
microseconds on each whatever it computes: the norm before a layer's QKV and gate/up matmuls
was four of them (the squares, their sum, the rsqrt, the scaling and rounding), twice a layer
on SmolLM2, where every packed kernel can norm its few input rows in the call itself (the
rows normed in float32 as layers.rms_norm does, rounded to the weights' dtype as an unfused
call's input is, then the same matmul: matmul.cc's NormMatmulPackedImpl, quant_matmul.h's
NormMatmulQuantImpl). Not AMX: its bf16 tiles take the unfused norm.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    NORM_MATMUL_BF16_DOT_TARGET,
    NORM_MATMUL_BF16_WIDE_TARGET,
    NORM_MATMUL_F32_TARGET,
    NORM_MATMUL_INT4_TARGET,
    NORM_MATMUL_INT8_TARGET,
    NORM_SWIGLU_BF16_DOT_TARGET,
    NORM_SWIGLU_BF16_WIDE_TARGET,
    NORM_SWIGLU_F32_TARGET,
    NORM_SWIGLU_INT4_TARGET,
    NORM_SWIGLU_INT8_TARGET,
)
from jaxcb.native.matmul import ALL_PACKED, _real_rows, layer_operands

#: packed kernel name -> (its norm-fused matmul target, its norm-fused SwiGLU target)
NORM_TARGETS = {
    "avx512_bf16": (NORM_MATMUL_BF16_DOT_TARGET, NORM_SWIGLU_BF16_DOT_TARGET),
    "avx512": (NORM_MATMUL_F32_TARGET, NORM_SWIGLU_F32_TARGET),
    "avx2_bf16": (NORM_MATMUL_BF16_WIDE_TARGET, NORM_SWIGLU_BF16_WIDE_TARGET),
    "avx2": (NORM_MATMUL_F32_TARGET, NORM_SWIGLU_F32_TARGET),
    "int8": (NORM_MATMUL_INT8_TARGET, NORM_SWIGLU_INT8_TARGET),
    "int4": (NORM_MATMUL_INT4_TARGET, NORM_SWIGLU_INT4_TARGET),
}


def packed_norm_matmul(
    kernel: str,
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    w_packed: jax.Array,
    rows: Any = None,
    *,
    swiglu: bool = False,
    layer: Any = None,
) -> jax.Array:
    """`packed_matmul(kernel, rms_norm(x, weight, eps), w_packed, rows)` (`swiglu`: the fused
    SwiGLU's, [M, I] in the kernel's act_dtype) in one call of `kernel` (a NORM_TARGETS
    name): x f32[M, K], weight [K] (bfloat16 as it is, else float32); only the real rows are
    normed and multiplied, the rest come out zero. `layer`: w_packed is every layer's stack,
    layer `layer`'s read in place (matmul.layer_operands)."""
    spec = ALL_PACKED[kernel]
    matmul_target, swiglu_target = NORM_TARGETS[kernel]
    w, index, shape = layer_operands(w_packed, layer)
    blocks = shape[0]
    if swiglu and blocks % 2:
        raise ValueError(f"swiglu needs a [K, 2 * I] weight, I a multiple of 16: {shape}")
    n = blocks * 8 if swiglu else blocks * 16
    call = jax.ffi.ffi_call(
        spec.target(swiglu_target if swiglu else matmul_target),
        jax.ShapeDtypeStruct((x.shape[0], n), spec.act_dtype if swiglu else jnp.float32),
    )
    return call(
        x.astype(jnp.float32),
        weight if weight.dtype == jnp.bfloat16 else weight.astype(jnp.float32),
        w,
        index,
        _real_rows(x, rows),
        eps=np.float32(eps),
    )
