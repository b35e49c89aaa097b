"""Grouped matmuls over packed weights: a mixture of experts' rows, sorted by expert, each
multiplied by its own expert's matrix only.

XLA's CPU backend lowers jax.lax.ragged_dot densely: every row meets every group's matrix and
the products are masked (8 experts, 512 rows x 512 x 1024 float32: 32 ms against 3.9 ms for
one dense matmul of the same rows). The native kernels (matmul.cc, GroupedMatmulImpl and
GroupedMatmulAmxImpl) run each expert's row range through the plain packed matmul's tiles
over that expert's slice of a stack of packed weights, and skip the experts no row chose.

The weights are the per-matrix layouts of packing.py stacked, [E, ...packed]: each kernel of
PACKED_MATMULS has a grouped form with its weight dtype, input rounding and tiles, so an
expert weight is packed for whichever kernel the dense weights use. Quantized (int8) expert
weights have no grouped kernel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    GROUPED_MATMUL_AMX_TARGET,
    GROUPED_MATMUL_BF16_DOT_TARGET,
    GROUPED_MATMUL_BF16_WIDE_TARGET,
    GROUPED_MATMUL_F32_TARGET,
    GROUPED_SWIGLU_BF16_DOT_TARGET,
    GROUPED_SWIGLU_BF16_WIDE_TARGET,
    GROUPED_SWIGLU_F32_TARGET,
)
from jaxcb.native.matmul import PACKED_MATMULS, _kernel_input, layer_operands


class GroupedTargets(NamedTuple):
    """The FFI targets of one kernel's grouped matmuls, in that kernel's library."""

    matmul: str
    swiglu: str | None  # silu(gate) * up in the epilogue; None: not fused (as the dense one)


_F32 = GroupedTargets(GROUPED_MATMUL_F32_TARGET, GROUPED_SWIGLU_F32_TARGET)

#: PACKED_MATMULS name -> its grouped FFI targets.
GROUPED_TARGETS = {
    "amx": GroupedTargets(GROUPED_MATMUL_AMX_TARGET, None),
    "avx512_bf16": GroupedTargets(GROUPED_MATMUL_BF16_DOT_TARGET, GROUPED_SWIGLU_BF16_DOT_TARGET),
    "avx512": _F32,
    "avx2_bf16": GroupedTargets(GROUPED_MATMUL_BF16_WIDE_TARGET, GROUPED_SWIGLU_BF16_WIDE_TARGET),
    "avx2": _F32,
}


def can_pack_experts(kernel: str, shape: tuple[int, ...]) -> bool:
    """Whether an [E, in, ...] stack of expert weights fits `kernel`'s layout, each expert's
    matrix viewed as [in, -1]."""
    if kernel not in GROUPED_TARGETS or len(shape) < 3:
        return False
    return PACKED_MATMULS[kernel].can_pack((shape[1], int(np.prod(shape[2:]))))


def pack_experts(kernel: str, w: np.ndarray) -> np.ndarray:
    """An [E, in, ...] stack of expert weights (expert e's [in, out] matrix is w[e] viewed as
    [in, -1]) packed for `kernel`'s grouped matmul: [E, ...] of its per-matrix layout. A gate_up
    weight [E, in, 2, I] gives [in, 2 * I], gate columns then up: the fused SwiGLU's order."""
    spec = PACKED_MATMULS[kernel]
    w = np.asarray(w)
    if not can_pack_experts(kernel, w.shape):
        raise ValueError(f"cannot pack a {list(w.shape)} expert stack for {kernel}")
    return np.stack([spec.pack(expert.reshape(w.shape[1], -1)) for expert in w])


def _call(
    kernel: str,
    fused: bool,
    out: jax.ShapeDtypeStruct,
    x: jax.Array,
    w: jax.Array,
    index: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    spec = PACKED_MATMULS[kernel]
    if w.shape[1] != group_sizes.shape[0]:
        raise ValueError(f"{w.shape[1]} experts' weights but {group_sizes.shape[0]} group sizes")
    targets = GROUPED_TARGETS[kernel]
    call = jax.ffi.ffi_call(spec.target(targets.swiglu if fused else targets.matmul), out)
    return call(_kernel_input(spec, x), w, index, group_sizes.astype(jnp.int32))


def packed_grouped_matmul(
    kernel: str, x: jax.Array, w_packed: jax.Array, group_sizes: jax.Array, layer: Any = None
) -> jax.Array:
    """x [M, K], rows sorted by group, times their group's matrix: w_packed is
    `pack_experts(kernel, w)`, group_sizes i32[G] the rows of each group in order. f32[M, N];
    rows past sum(group_sizes) (a bucket's padding) are not computed and come out zero.
    `layer`: w_packed stacks every layer's experts, layer `layer`'s read in place
    (ops.layer_operands)."""
    w, index, shape = layer_operands(w_packed, layer)
    out = jax.ShapeDtypeStruct((x.shape[0], shape[1] * 16), jnp.float32)
    return _call(kernel, False, out, x, w, index, group_sizes)


def packed_grouped_swiglu(
    kernel: str, x: jax.Array, w_packed: jax.Array, group_sizes: jax.Array, layer: Any = None
) -> jax.Array:
    """silu(gate) * up of each row through its group's [K, 2 * I] gate_up matrix (gate columns,
    then up; I a multiple of 16), as `packed_grouped_matmul` (`layer` too): [M, I] in the
    kernel's act_dtype (bf16 after vdpbf16ps, as the dense fused SwiGLU writes it)."""
    if GROUPED_TARGETS[kernel].swiglu is None:
        raise ValueError(f"{kernel} has no fused grouped SwiGLU (its grouped matmul does)")
    w, index, shape = layer_operands(w_packed, layer)
    if shape[1] % 2:
        raise ValueError(f"swiglu needs [K, 2 * I] weights, I a multiple of 16: {shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], shape[1] * 8), PACKED_MATMULS[kernel].act_dtype)
    return _call(kernel, True, out, x, w, index, group_sizes)
