"""The native CPU matmul kernels (matmul.cc) as jax functions, over weights packed once at
load time (packing.py): bfloat16 on AMX tiles, with AVX512-BF16 dot products (vdpbf16ps: AMD
Zen 4 and later, Intel Cooper Lake and later) or widened to float32 in registers (any CPU
with AVX2 + FMA), float32 with FMAs on AVX-512 or AVX2 vectors, whose LM head can also find
greedy tokens through a bf16 screen, and int8 / 4-bit codes. Each wrapper makes sure its ISA
level's library is built and registered (build.py) and calls its FFI target;
`PACKED_MATMULS` is the table of packed matmul kernels the model code dispatches to
(jaxcb/models/packed.py), with the ISA level each needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    ISA_ENV,
    ISA_LEVELS,
    MATMUL_AMX_TARGET,
    MATMUL_ARGMAX_BF16_DOT_TARGET,
    MATMUL_ARGMAX_BF16_WIDE_TARGET,
    MATMUL_ARGMAX_F32_TARGET,
    MATMUL_ARGMAX_SCREENED_F32_TARGET,
    MATMUL_BF16_DOT_TARGET,
    MATMUL_BF16_WIDE_TARGET,
    MATMUL_F32_TARGET,
    MATMUL_INT4_TARGET,
    MATMUL_INT8_TARGET,
    SWIGLU_BF16_DOT_TARGET,
    SWIGLU_BF16_WIDE_TARGET,
    SWIGLU_F32_TARGET,
    SWIGLU_INT4_TARGET,
    SWIGLU_INT8_TARGET,
    NativeBuildError,
    active_level,
    cpu_summary,
    level_at_least,
    load,
    registered_target,
    supported_levels,
)
from jaxcb.native.packing import (
    can_pack_bf16,
    can_pack_f32,
    can_pack_int8,
    pack_bf16,
    pack_f32,
    pack_int4,
    pack_int8,
)


def _real_rows(x: jax.Array, rows: jax.Array | int | None) -> jax.Array:
    """i32[1]: how many leading rows of x are real (all of them if None); the kernels compute
    only those and write zeros to the rest (a bucket's padding)."""
    if rows is None:
        return jnp.full((1,), x.shape[0], jnp.int32)
    return jnp.reshape(jnp.asarray(rows, jnp.int32), (1,))


def _kernel_input(spec: PackedMatmul, x: jax.Array) -> jax.Array:
    """x rounded to the weights' dtype (every kernel multiplies in it, as XLA's dot of the
    same weights does: the same tokens on every ISA), in the dtype the kernel reads; int8
    weights are multiplied in float32 (models/quant.py)."""
    if not jnp.issubdtype(spec.dtype, jnp.floating):
        return x.astype(spec.x_dtype)
    return x.astype(spec.dtype).astype(spec.x_dtype)


def layer_operands(w_packed: jax.Array, layer: Any) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
    """(the weight as a stack over layers, the layer's index as i32[1], one layer's shape):
    the per-layer kernels take a [L, ...] stack of every layer's packed weight and the index
    of the one to read in place (a step looping over the layers copies no weights out);
    `layer` None: w_packed is one layer's weight, sent as a stack of one."""
    if layer is None:
        return w_packed[None], jnp.zeros((1,), jnp.int32), w_packed.shape
    return w_packed, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), w_packed.shape[1:]


#: Work-item slots of the argmax matmuls' partial results (the kernel uses at most this many
#: items; more than enough to keep a few cores busy on an LM head).
ARGMAX_SLOTS = 64


def packed_matmul(
    kernel: str, x: jax.Array, w_packed: jax.Array, rows: Any = None, layer: Any = None
) -> jax.Array:
    """x [M, K] @ w [K, N] on the native kernel `kernel` (a PACKED_MATMULS name), w packed by
    its `pack`: f32[M, N], accumulated in float32. `rows` (i32 scalar or [1], default M): only
    the first `rows` rows of x are real; the others are not computed and come out zero.
    `layer` (an int or i32 scalar, may be traced): w_packed is a [L, ...] stack of every
    layer's packed weight and layer `layer`'s is read in place (`layer_operands`)."""
    spec = ALL_PACKED[kernel]
    w, index, shape = layer_operands(w_packed, layer)
    n = shape[0] * 16
    call = jax.ffi.ffi_call(
        spec.target(spec.matmul_target), jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    )
    return call(_kernel_input(spec, x), w, index, _real_rows(x, rows))


def packed_matmul_argmax(
    kernel: str, x: jax.Array, w_packed: jax.Array, rows: Any = None
) -> tuple[jax.Array, jax.Array]:  # (f32[M, N], i32[M])
    """`packed_matmul`, plus the argmax of each output row (first index on ties) taken from
    the accumulators on the way out: an LM head's greedy tokens without another pass over its
    [M, vocab] logits. Padding rows (past `rows`) get token 0."""
    spec = ALL_PACKED[kernel]
    m, n = x.shape[0], w_packed.shape[0] * 16
    call = jax.ffi.ffi_call(
        spec.target(spec.argmax_target),
        (
            jax.ShapeDtypeStruct((m, n), jnp.float32),
            jax.ShapeDtypeStruct((m, ARGMAX_SLOTS), jnp.float32),
            jax.ShapeDtypeStruct((m, ARGMAX_SLOTS), jnp.int32),
        ),
    )
    out, best_val, best_idx = call(_kernel_input(spec, x), w_packed, _real_rows(x, rows))
    # Slots cover increasing column ranges: the first slot holding the row's max holds its
    # first argmax, as jnp.argmax would pick it.
    slot = jnp.argmax(best_val, axis=1)
    return out, jnp.take_along_axis(best_idx, slot[:, None], axis=1)[:, 0]


def packed_swiglu(
    kernel: str, x: jax.Array, w_packed: jax.Array, rows: Any = None, layer: Any = None
) -> jax.Array:
    """silu(gate) * up for gate_up = x @ w, w [K, 2 * I] (gate columns, then up) packed for
    `kernel`: its matmul with the activation in the epilogue, [M, I] in the kernel's
    `act_dtype` (bf16 after vdpbf16ps: the next matmul's input as it is); `rows` and
    `layer` as there."""
    spec = ALL_PACKED[kernel]
    w, index, shape = layer_operands(w_packed, layer)
    if shape[0] % 2:
        raise ValueError(f"swiglu needs a [K, 2 * I] weight, I a multiple of 16: {shape}")
    i = shape[0] * 8
    call = jax.ffi.ffi_call(
        spec.target(spec.swiglu_target), jax.ShapeDtypeStruct((x.shape[0], i), spec.act_dtype)
    )
    return call(_kernel_input(spec, x), w, index, _real_rows(x, rows))


def matmul_argmax_screened_f32(
    x: jax.Array,  # f32[M, K]
    w_packed: jax.Array,  # pack_f32(w)
    screen: dict[str, jax.Array],  # pack_argmax_screen(w)
    rows: Any = None,
    *,
    kernel: str = "avx512",
) -> tuple[jax.Array, jax.Array]:  # (f32[M, N], i32[M])
    """The greedy tokens of `packed_matmul_argmax(kernel, x, w_packed, rows)` (a float32
    kernel), bit for bit (first index on ties), for about the cost of a bf16 matmul: x @ w in
    bf16, then only the few columns whose error bound lets them hold a row's maximum
    recomputed in float32. The first result is the bf16 products, not float32 logits: for
    callers that need only the tokens."""
    spec = ALL_PACKED[kernel]
    if spec.dtype != jnp.float32:
        raise ValueError(f"the greedy screen is for float32 kernels, not {kernel!r}")
    m, n = x.shape[0], w_packed.shape[0] * 16
    call = jax.ffi.ffi_call(
        spec.target(MATMUL_ARGMAX_SCREENED_F32_TARGET),
        (jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.int32)),
    )
    return call(
        x.astype(jnp.float32),
        screen["screen_bf16"],
        w_packed,
        screen["screen_stats"],
        _real_rows(x, rows),
    )


class PackedMatmul(NamedTuple):
    """One native matmul kernel: what it takes, the ISA level it needs and its FFI targets.
    Every kernel takes the real-row count of x (the rest is a bucket's padding) and skips
    the padding rows."""

    name: str
    dtype: Any  # the weights' dtype it takes
    x_dtype: Any  # the dtype it reads activations in (rounded to `dtype` first)
    act_dtype: Any  # what its fused SwiGLU writes
    level: str  # the ISA level it needs (build.ISA_LEVELS)
    # Its library: its own level's ("avx2": the AVX2 code even on an AVX-512 CPU), or else the
    # active level's (the widest vectors this CPU runs).
    own_library: bool
    feature: str  # the build.Features flag its library must report
    can_pack: Callable[[tuple[int, ...]], bool]
    pack: Callable[[np.ndarray], np.ndarray]
    matmul_target: str
    swiglu_target: str | None = None
    argmax_target: str | None = None
    about: str = ""

    def library_level(self) -> str:
        return self.level if self.own_library else active_level()

    def target(self, base: str) -> str:
        """The FFI target of `base` in this kernel's library (built and registered now)."""
        return registered_target(base, self.library_level())

    def unavailable_reason(self) -> str | None:
        """Why this kernel cannot run here (None: it can), in a few words."""
        active = active_level()
        if not level_at_least(active, self.level):
            if self.level in supported_levels():
                return f"{ISA_ENV} caps the kernels at {active}"
            return f"this CPU has no {ISA_LEVELS[self.level].about}: {cpu_summary()}"
        try:
            features = load(self.library_level())
        except (NativeBuildError, OSError) as exc:
            return f"the {self.library_level()} kernels did not build: {str(exc).splitlines()[0]}"
        if not getattr(features, self.feature):
            return f"the {self.library_level()} library has no {self.about}"
        return None

    def available(self) -> bool:
        return self.unavailable_reason() is None

    # (x, packed weight, rows=None, layer=None) -> f32[M, N]
    def kernel(
        self, x: jax.Array, w_packed: jax.Array, rows: Any = None, layer: Any = None
    ) -> jax.Array:
        return packed_matmul(self.name, x, w_packed, rows, layer)

    # (x, packed [K, 2 * I] gate_up weight, rows=None, layer=None) -> silu(gate) * up, or None
    # (not fused)
    @property
    def swiglu(self) -> Callable[..., jax.Array] | None:
        return None if self.swiglu_target is None else functools.partial(packed_swiglu, self.name)

    # (x, packed weight, rows=None) -> (x @ w, argmax of each row), or None
    @property
    def argmax(self) -> Callable[..., tuple[jax.Array, jax.Array]] | None:
        if self.argmax_target is None:
            return None
        return functools.partial(packed_matmul_argmax, self.name)


def _table(*specs: PackedMatmul) -> dict[str, PackedMatmul]:
    return {spec.name: spec for spec in specs}


_F32 = dict(dtype=jnp.float32, x_dtype=jnp.float32, act_dtype=jnp.float32, feature="v16")
_F32_TARGETS = dict(
    can_pack=can_pack_f32,
    pack=pack_f32,
    matmul_target=MATMUL_F32_TARGET,
    swiglu_target=SWIGLU_F32_TARGET,
    argmax_target=MATMUL_ARGMAX_F32_TARGET,
)

#: kernels.matmul name -> its kernel, in the order "auto" prefers them (per weight dtype)
PACKED_MATMULS = _table(
    PackedMatmul(
        "amx",
        jnp.bfloat16,
        jnp.bfloat16,
        jnp.bfloat16,
        "amx",
        False,
        "amx",
        can_pack_bf16,
        pack_bf16,
        MATMUL_AMX_TARGET,
        about="AMX bf16 tiles (or the OS refused the tile state)",
    ),
    PackedMatmul(
        "avx512_bf16",
        jnp.bfloat16,
        jnp.bfloat16,
        jnp.bfloat16,
        "avx512_bf16",
        False,
        "bf16_dot",
        can_pack_bf16,
        pack_bf16,
        MATMUL_BF16_DOT_TARGET,
        SWIGLU_BF16_DOT_TARGET,
        MATMUL_ARGMAX_BF16_DOT_TARGET,
        about="AVX512-BF16 dot products",
    ),
    PackedMatmul(
        "avx512", **_F32, level="avx512", own_library=False, **_F32_TARGETS, about="AVX-512 FMAs"
    ),
    PackedMatmul(
        "avx2_bf16",
        jnp.bfloat16,
        jnp.float32,
        jnp.float32,
        "avx2",
        True,
        "v16",
        can_pack_bf16,
        pack_bf16,
        MATMUL_BF16_WIDE_TARGET,
        SWIGLU_BF16_WIDE_TARGET,
        MATMUL_ARGMAX_BF16_WIDE_TARGET,
        about="bf16 weights widened in AVX2 registers",
    ),
    PackedMatmul("avx2", **_F32, level="avx2", own_library=True, **_F32_TARGETS, about="AVX2 FMAs"),
)

#: The kernel of quantized weights (models/quant.py), whatever the model dtype: not a
#: kernels.matmul choice; the packing puts int8 weights on it where it can run.
INT8_MATMUL = PackedMatmul(
    "int8",
    jnp.int8,
    jnp.float32,
    jnp.float32,
    "avx2",
    False,
    "v16",
    can_pack_int8,
    pack_int8,
    MATMUL_INT8_TARGET,
    SWIGLU_INT8_TARGET,
    about="int8 codes widened in AVX2 / AVX-512 registers",
)
#: The kernel of quantized weights whose codes fit 4 bits (GGUF Q4_0 / Q4_1 blocks).
INT4_MATMUL = INT8_MATMUL._replace(
    name="int4",
    can_pack=can_pack_int8,
    pack=pack_int4,
    matmul_target=MATMUL_INT4_TARGET,
    swiglu_target=SWIGLU_INT4_TARGET,
    about="4-bit codes widened in AVX2 / AVX-512 registers",
)
#: Every packed weight's kernel by the name its {name: packed} dict carries.
ALL_PACKED = {**PACKED_MATMULS, INT8_MATMUL.name: INT8_MATMUL, INT4_MATMUL.name: INT4_MATMUL}
