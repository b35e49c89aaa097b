"""Weight quantization: int8 weight-only, a scale and a zero point per group of inputs.

A quantized weight is the pytree {"q": int8 [in, ...], "scale", "zero": [in / G, ...]}: the
weight ≈ q * scale + zero, each output channel's inputs in groups of G = 32 (GGUF's block
size; the whole input axis where 32 does not divide it), the group's [min, max] spread over
the 256 int8 values. Asymmetric, as GGUF's Q4_1/Q5_1: a Q4_1 block's 16 levels are 17 int8
steps apart, so a model that came as Q4_1 (the default SmolLM2 file) is held to float
rounding; a symmetric scale (max magnitude -> 127) lost that grid and a quarter of the
greedy tokens of the real-model chat set diverged from float32's.

The scales and zero points are in the model's dtype; `packed.matmul` dequantizes to it and
multiplies as for a plain weight (`layers.dense`), so a float32 engine computes in float32
and a bfloat16 one in bfloat16 (w8a16). CPU only for now (`check_platform`): XLA
materializes the dequantized weights every step, which on CPU is slow (the native CPU
kernels do not take int8 yet) and on GPU/TPU moves more bytes than bfloat16 does: a fused
int8 matmul kernel is what they need.

`quantize_params` quantizes every layer matmul weight (the ParamInfos marked `matmul`);
the embedding table and the output head stay in the model dtype (vLLM's int8 schemes keep
them too: the head's error lands directly on the logits). The declarations follow: `q`,
`scale` and `zero` keep the weight's logical axes (tensor parallelism splits them as it
split the weight; a split input axis splits whole groups where 32 x TP divides it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.config import QUANTIZATIONS  # "none" (the model dtype), "int8" (w8a16 above)
from jaxcb.models.base import ParamInfo, Params, is_param_info
from jaxcb.models.layers import dense

INT8_MAX = 127


def is_quantized(w: Any) -> bool:
    return isinstance(w, dict) and set(w) == {"q", "scale", "zero"}


#: Input rows that share a scale (GGUF's block size): per output channel, every 32 inputs.
GROUP_SIZE = 32


def group_size(num_inputs: int) -> int:
    """GROUP_SIZE where it divides the input axis, else the whole axis (one scale per
    output channel)."""
    return GROUP_SIZE if num_inputs % GROUP_SIZE == 0 else num_inputs


@jax.jit
def quantize_int8(w: jax.Array) -> dict[str, jax.Array]:
    """{"q": int8 w.shape, "scale", "zero": [in / G, *w.shape[1:]] in w's dtype}: w [in, ...]
    with one scale and zero point per output channel and group of G = group_size(in)
    inputs, the group's range [min, max] spread over the 256 int8 values."""
    g = group_size(w.shape[0])
    w32 = w.astype(jnp.float32).reshape(w.shape[0] // g, g, *w.shape[1:])
    lo, hi = jnp.min(w32, axis=1), jnp.max(w32, axis=1)
    scale = jnp.where(hi > lo, (hi - lo) / 255, 1.0)
    q = jnp.clip(jnp.round((w32 - lo[:, None]) / scale[:, None]), 0, 255) - 128
    zero = lo + 128 * scale
    return {
        "q": q.astype(jnp.int8).reshape(w.shape),
        "scale": scale.astype(w.dtype),
        "zero": zero.astype(w.dtype),
    }


def dequantize(w: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """The weight a quantized one stands for, in `dtype` (the arithmetic in `dtype` too:
    one elementwise expression XLA can fuse into the consumer's operand)."""
    q, scale, zero = w["q"], w["scale"].astype(dtype), w["zero"].astype(dtype)
    groups = scale.shape[0]
    grouped = q.reshape(groups, q.shape[0] // groups, *q.shape[1:]).astype(dtype)
    return (grouped * scale[:, None] + zero[:, None]).reshape(q.shape)


def int8_matmul(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [T, in] @ a quantized [in, ...] weight viewed as [in, out]: float32 [T, out], the
    weight dequantized to its scales' dtype (the model's) and multiplied as `layers.dense`
    does (XLA fuses the dequantization into the dot on GPU and TPU)."""
    weight = dequantize(w, w["scale"].dtype)
    return dense(x, weight.reshape(weight.shape[0], -1))


def check_platform(quantization: str, platform: str) -> None:
    """One-line ValueError for a quantization the platform cannot run well yet: int8 on
    GPU/TPU, where XLA materializes the dequantized weights instead of fusing them into the
    dot (compiled for v5e x4, a 2-layer Qwen3-8B decode step moved 10.4 GB instead of
    bfloat16's 0.84; for H100, 61.5 GB instead of 39.7 at the 8B preset's 16 sequences)."""
    if quantization != "none" and platform != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on CPU only for now: on {platform} XLA "
            "would materialize the dequantized weights every step (no fused int8 matmul yet)"
        )


def _check(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")


def _quantized_info(info: ParamInfo) -> dict[str, ParamInfo]:
    groups = info.shape[0] // group_size(info.shape[0])
    return {
        "q": ParamInfo(info.shape, info.axes, matmul=True, dtype="int8"),
        "scale": ParamInfo((groups, *info.shape[1:]), info.axes),  # the model's dtype
        "zero": ParamInfo((groups, *info.shape[1:]), info.axes),
    }


def quantized_infos(infos: Params, quantization: str) -> Params:
    """The declarations of `quantize_params`' result (for abstract params: runtime/aot.py)."""
    _check(quantization)
    if quantization == "none":
        return infos
    infos = dict(infos)
    infos["layers"] = [
        {k: _quantized_info(v) if is_param_info(v) and v.matmul else v for k, v in layer.items()}
        for layer in infos["layers"]
    ]
    return infos


def quantize_params(params: Params, infos: Params, quantization: str) -> tuple[Params, Params]:
    """(params, infos) with every layer matmul weight quantized (see the module doc);
    unchanged for "none". The output head and the embedding table are left as they are."""
    new_infos = quantized_infos(infos, quantization)
    if quantization == "none":
        return params, infos
    params = dict(params)
    params["layers"] = [
        {k: quantize_int8(w) if is_param_info(info[k]) and info[k].matmul else w
         for k, w in layer.items()}
        for layer, info in zip(params["layers"], infos["layers"], strict=True)
    ]  # fmt: skip
    return params, new_infos


def weight_bytes(params: Params) -> int:
    """Bytes of a params pytree (quantized weights at their stored size)."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))
