"""Matmuls of the model code, over plain weights or weights packed for a native CPU kernel.

Every family multiplies through `matmul` (and `swiglu` / `lm_head` where it fits): a plain
[in, out] weight goes to XLA (`layers.dense`); a weight packed for one of jaxcb's native CPU
kernels, stored as {kernel: packed} ("amx", "avx512_bf16" or "avx2_bf16" for bfloat16,
"avx512" or "avx2" for float32, "int8" for quantized weights whatever the model dtype;
jaxcb.native.ALL_PACKED), goes to that kernel. The runner decides (through
`cpu_params.matmul_backend`) and packs once at load (`cpu_params.prepare_cpu_params`), so
the forward code is the same on every backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcb import native
from jaxcb.models.base import Params
from jaxcb.models.layers import dense, precision, rms_norm
from jaxcb.models.quant import CODE_OFFSET, is_quantized, quantized_matmul

logger = logging.getLogger(__name__)


class LayerWeight(NamedTuple):
    """Layer `index` of a weight packed for a native kernel and stacked over a run of layers
    ({kernel: [n, ...packed]}, models/stacking.py): the kernel takes the stack and the index
    and reads that layer in place (`at_layer` makes these)."""

    kernel: str
    stack: jax.Array
    index: Any  # int, or an i32 scalar traced in a scan over the layers


class LayerSlots(NamedTuple):
    """Layer `index` of a run's LoRA slot arrays (jaxcb/lora.py), left stacked by `at_layer`:
    the layer is sliced inside the branch that reads it, which runs only when some row has an
    adapter (`lora.add_adapters`), so a step without one neither reads nor copies it."""

    stack: Params
    index: Any  # int, or an i32 scalar traced in a scan over the layers


Weight = jax.Array | dict[str, jax.Array] | LayerWeight


def at_layer(stack: Params, index: Any) -> Params:
    """Layer `index` (an int, or traced) of a run's params stacked over its layers: a weight
    packed for a native kernel as a LayerWeight (read in place by the kernel), every other
    array its slice (norms, biases; and on XLA every matmul weight, whose slice XLA fuses
    into the op that reads it on accelerators). LoRA slot arrays ("lora") stay stacked, as
    LayerSlots."""

    def one(w: Any) -> Any:
        if (packed := _packed(w)) is not None:
            return LayerWeight(packed[0], packed[1], index)
        return jax.tree_util.tree_map(lambda a: a[index], w)

    return {name: LayerSlots(w, index) if name == "lora" else one(w) for name, w in stack.items()}


def _packed(w: Any) -> tuple[str, jax.Array] | None:
    """(kernel, packed array) of a {kernel: packed} weight for a native kernel; else None."""
    if isinstance(w, dict) and len(w) == 1 and not is_quantized(w):
        ((kernel, packed),) = w.items()
        if kernel in native.ALL_PACKED:
            return kernel, packed
    return None


def native_weight(w: Any) -> tuple[str, jax.Array, Any] | None:
    """(kernel, packed, layer index or None) of a weight a native kernel runs: {kernel:
    packed}, or a LayerWeight of a stack of them; None for a plain or XLA-quantized one."""
    if isinstance(w, LayerWeight):
        return w.kernel, w.stack, w.index
    if (packed := _packed(w)) is not None:
        return (*packed, None)
    return None


class Normed(NamedTuple):
    """rms_norm(x, weight, eps), left to the matmul that takes it (`normed`): the int8 /
    int4 kernels norm their input rows in their own call (native.packed_norm_matmul)."""

    x: jax.Array
    weight: jax.Array
    eps: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    def value(self) -> jax.Array:
        return rms_norm(self.x, self.weight, self.eps)


def normed(x: jax.Array, weight: jax.Array, eps: float, w: Weight) -> jax.Array | Normed:
    """rms_norm(x, weight, eps) as the input of `matmul(., w)` (and of `packed_swiglu(w)`'s
    kernel): left as a Normed for a packed quantized weight, whose kernel norms the rows in
    its call (three fewer XLA ops); computed here for any other weight."""
    if _norm_kernel(w) is None:
        return rms_norm(x, weight, eps)
    return Normed(x, weight, eps)


def _norm_kernel(w: Weight) -> str | None:
    found = native_weight(w)
    if found is not None and found[0] in native.NORM_TARGETS:
        return found[0]
    return None


def matmul(x: jax.Array | Normed, w: Weight, rows: jax.Array | None = None) -> jax.Array:
    """x @ w for a [in, ...] weight viewed as [in, out] (float32 result), a weight packed
    for a native kernel ({kernel name: packed}), or a quantized one (models/quant.py).
    `rows` (i32 scalar): how many leading rows of x are real, the rest a bucket's padding;
    the native kernels skip the padding and return zeros there, XLA computes it. x may be
    a `Normed` (rms_norm(x) left to the kernel)."""
    found = native_weight(w)
    if isinstance(x, Normed):
        if _norm_kernel(w) is not None:
            kernel, packed, layer = found
            return native.packed_norm_matmul(
                kernel, x.x, x.weight, x.eps, packed, rows, layer=layer
            )
        x = x.value()
    if found is not None:
        kernel, packed, layer = found
        return native.ALL_PACKED[kernel].kernel(x, packed, rows, layer)
    if is_quantized(w):
        return quantized_matmul(x, w)
    return dense(x, w.reshape(w.shape[0], -1))


def grouped_matmul(x: jax.Array, w: Weight, group_sizes: jax.Array) -> jax.Array:
    """Rows of x sorted by group (a mixture of experts' tokens by expert) times their group's
    matrix: x [M, in], w [G, in, ...] (expert g's [in, out] matrix is w[g] viewed as [in,
    -1]), group_sizes i32[G] (rows past their sum come out zero). float32 result [M, out].

    A stack packed for a native kernel ({kernel: packed}, `prepare_cpu_params`) runs each
    group's rows through its own expert only (native.packed_grouped_matmul); a plain array goes
    to jax.lax.ragged_dot, which XLA's CPU backend computes densely (every row times every
    expert, masked). Quantized (int8) expert weights are not supported."""
    if (found := native_weight(w)) is not None:
        kernel, packed, layer = found
        return native.packed_grouped_matmul(kernel, x, packed, group_sizes, layer)
    if is_quantized(w):
        raise NotImplementedError("quantized expert weights: grouped_matmul takes float ones")
    groups, rows_in = w.shape[0], w.shape[1]
    return jax.lax.ragged_dot(
        x.astype(w.dtype),
        w.reshape(groups, rows_in, -1),
        group_sizes,
        precision=precision(w.dtype),
        preferred_element_type=jnp.float32,
    )


def grouped_swiglu(x: jax.Array, w: Weight, group_sizes: jax.Array) -> jax.Array:
    """silu(gate) * up of x's rows (sorted by group, as for grouped_matmul) through their
    group's gate_up weight, w [G, in, 2, I]: [M, I], float32 (or bf16 from a native kernel
    that writes it so, as its dense fused SwiGLU: the next matmul's input as it is).

    Packed (as [in, 2 * I] per expert: gate columns, then up), the native kernel fuses the
    activation into its epilogue when it can (I a multiple of 16; not on AMX, as the dense
    path), else one grouped matmul gives both halves. Plain, gate and up are two grouped
    matmuls over w's halves, never one over a merged 2 * I axis: tensor parallelism shards
    I, and a merged axis would not split evenly."""
    if (found := native_weight(w)) is not None:
        kernel, packed, layer = found
        blocks = packed.shape[1 if layer is None else 2]  # (a stack's axis 0: its layers)
        if native.GROUPED_TARGETS[kernel].swiglu and blocks % 2 == 0:
            return native.packed_grouped_swiglu(kernel, x, packed, group_sizes, layer)
        gate_up = grouped_matmul(x, w, group_sizes).reshape(x.shape[0], 2, -1)
        return jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
    gate = grouped_matmul(x, w[:, :, 0], group_sizes)
    up = grouped_matmul(x, w[:, :, 1], group_sizes)
    return jax.nn.silu(gate) * up


def matmul_and_argmax(
    x: jax.Array, w: Weight, rows: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """`matmul(x, w, rows)` and, when the weight's native kernel takes it from its
    accumulators on the way out, the argmax of each result row (i32, first index on ties);
    else None."""
    found = native_weight(w)
    if found is not None and found[2] is None:  # (an output head: never a layer's)
        argmax = native.ALL_PACKED[found[0]].argmax
        if argmax is not None:
            return argmax(x, found[1], rows)
    return matmul(x, w, rows), None


def packed_swiglu(w: Weight) -> Callable[..., jax.Array] | None:
    """For a gate_up weight packed for a native kernel that fuses silu(gate) * up into its
    epilogue: that fused kernel (x, rows) -> act; else None."""
    found = native_weight(w)
    if found is None:
        return None
    kernel, packed, layer = found
    fused = native.ALL_PACKED[kernel].swiglu
    if fused is None or packed.shape[0 if layer is None else 1] % 2:
        return None

    def swiglu(x: jax.Array | Normed, rows: Any = None) -> jax.Array:
        if isinstance(x, Normed):
            if kernel in native.NORM_TARGETS:
                return native.packed_norm_matmul(
                    kernel, x.x, x.weight, x.eps, packed, rows, swiglu=True, layer=layer
                )
            x = x.value()
        return fused(x, packed, rows, layer)

    return swiglu


def lm_head(
    params: Params, h: jax.Array, rows: jax.Array, need_logits: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """f32[S, V] logits of the final hidden states h [S, H] and, where the LM head's kernel
    computes them on the way, their greedy tokens (i32[S]; else None).

    With an `lm_head_screen` (prepare_cpu_params) and `need_logits` false, the greedy tokens
    are exact but the logits only their bf16 screen (native.matmul_argmax_screened_f32)."""
    weight = lm_head_weight(params)

    def exact(h: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        return matmul_and_argmax(h, weight, rows)

    if "lm_head_screen" not in params:
        return exact(h)

    ((kernel, packed),) = weight.items()

    def screened(h: jax.Array) -> tuple[jax.Array, jax.Array]:  # the same tokens
        return native.matmul_argmax_screened_f32(
            h, packed, params["lm_head_screen"], rows, kernel=kernel
        )

    return jax.lax.cond(need_logits, exact, screened, h)


def lm_head_weight(params: Params) -> Weight:
    """The output head as a `matmul` weight: params["lm_head"] ([H, V], or packed), else
    the tied embedding table transposed."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def embed_lookup(embed: jax.Array, input_ids: jax.Array) -> jax.Array:
    """Rows of the embedding table as float32 (a bf16 table kept as raw uint16 bits by
    prepare_cpu_params is viewed back as bf16 first)."""
    x = embed[input_ids]
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


def embed_tokens(params: Params, input_ids: jax.Array) -> jax.Array:
    """The input tokens' embeddings, f32[T, H]: rows of params["embed"], or, where
    prepare_cpu_params left the table out (tied to a quantized head), the head's columns
    dequantized (`head_columns`)."""
    if "embed" in params:
        return embed_lookup(params["embed"], input_ids)
    return head_columns(params["lm_head"], input_ids)


def head_columns(head: Weight, ids: jax.Array) -> jax.Array:
    """Columns `ids` of a quantized [H, V] weight as f32[T, H] rows: from models/quant.py's
    form (q, scale, min), or from the int8 / int4 kernels' packed layouts
    (native/packing.py): each id's 16-column block gathered, its column picked out."""
    if is_quantized(head):
        q, scale, minimum = (head[k][:, ids].T.astype(jnp.float32) for k in ("q", "scale", "min"))
        groups = scale.shape[1]
        codes = q.reshape(q.shape[0], groups, -1) + CODE_OFFSET
        return (codes * scale[:, :, None] + minimum[:, :, None]).reshape(q.shape)
    ((kernel, packed),) = head.items()
    blocks = packed[ids // 16]  # u8[T, K/32, group bytes]
    column = (ids % 16)[:, None, None, None, None]
    t, groups, size = blocks.shape
    code_bytes = 256 if kernel == native.INT4_MATMUL.name else 512

    def pick(part: jax.Array, width: int) -> jax.Array:  # column c of [.., 16, width] runs
        runs = part.reshape(t, groups, -1, 16, width)
        return jnp.take_along_axis(runs, column, axis=3)[:, :, :, 0]

    def halves(at: int) -> jax.Array:  # 16 float16 values a group, column c's
        f16 = pick(blocks[:, :, at : at + 32], 2)[:, :, 0]
        return jax.lax.bitcast_convert_type(f16, jnp.float16).astype(jnp.float32)

    quads = pick(blocks[:, :, :code_bytes], 4).reshape(t, groups, -1)  # input 4 p + j's byte
    if code_bytes == 256:  # low nibbles inputs 0..15, high nibbles 16..31
        codes = jnp.concatenate([quads & 15, quads >> 4], axis=2).astype(jnp.float32)
    else:
        codes = jax.lax.bitcast_convert_type(quads, jnp.int8).astype(jnp.float32) + CODE_OFFSET
    scale = halves(code_bytes)[:, :, None]
    if size == code_bytes + 32:  # symmetric int8: weight = q x scale
        return ((codes - CODE_OFFSET) * scale).reshape(t, -1)
    return (codes * scale + halves(code_bytes + 32)[:, :, None]).reshape(t, -1)
