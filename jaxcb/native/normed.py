"""The quantized matmuls with the RMS norm before them in the same call.

A decode step of a small model is a few hundred ops, and XLA's CPU runtime spends a few
microseconds on each whatever it computes: the norm before a layer's QKV and gate/up matmuls
was three of them (the sum of squares, the rsqrt, the scaling), 61 times a step on SmolLM2,
where the int8 / int4 kernels can norm their few input rows in the call itself
(quant_matmul.h's NormMatmulQuantImpl: the rows normed in float32 as layers.rms_norm does,
then the same matmul).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    NORM_MATMUL_INT4_TARGET,
    NORM_MATMUL_INT8_TARGET,
    NORM_SWIGLU_INT4_TARGET,
    NORM_SWIGLU_INT8_TARGET,
)
from jaxcb.native.matmul import ALL_PACKED, _real_rows, layer_operands

#: packed kernel name -> (its norm-fused matmul target, its norm-fused SwiGLU target)
NORM_TARGETS = {
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
    SwiGLU's, [M, I]) in one call of `kernel` (a NORM_TARGETS name): x f32[M, K], weight [K]
    (bfloat16 as it is, else float32); only the real rows are normed and multiplied, the rest
    come out zero. `layer`: w_packed is every layer's stack, layer `layer`'s read in place
    (ops.layer_operands)."""
    spec = ALL_PACKED[kernel]
    matmul_target, swiglu_target = NORM_TARGETS[kernel]
    w, index, shape = layer_operands(w_packed, layer)
    blocks = shape[0]
    if swiglu and blocks % 2:
        raise ValueError(f"swiglu needs a [K, 2 * I] weight, I a multiple of 16: {shape}")
    n = blocks * 8 if swiglu else blocks * 16
    call = jax.ffi.ffi_call(
        spec.target(swiglu_target if swiglu else matmul_target),
        jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
    )
    return call(
        x.astype(jnp.float32),
        weight if weight.dtype == jnp.bfloat16 else weight.astype(jnp.float32),
        w,
        index,
        _real_rows(x, rows),
        eps=np.float32(eps),
    )
