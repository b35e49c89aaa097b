"""Weight quantization: int8 weight-only, a float16 scale and minimum per group of inputs.

A quantized weight is the pytree {"q": int8 [in, ...], "scale", "min": float16 [in / G, ...]}:
the weight = (q + 128) * scale + min, each output channel's inputs in groups of G = 32
(GGUF's block size; the whole input axis where 32 does not divide it). This is GGUF's Q4_1 /
Q8_1 form with 256 levels: a group's [min, max] spread over the codes 0..255 (stored as
q = code - 128, an int8). Asymmetric because a Q4_1 block's 16 levels are 17 codes apart: a
symmetric scale (max magnitude -> 127) lost that grid and a quarter of the greedy tokens of
the real-model chat set diverged from float32's. A GGUF file's Q8_0, Q4_0 and Q4_1 blocks fit
this form exactly (`quantize_int8`'s `grid`): Q8_0 d x q is code q + 128 at min -128 d, Q4_0
d x (q - 8) is code q at min -8 d, Q4_1 d x q + m is code q at min m, all in float16 as
GGUF stores them, so such weights load bit for bit.

float16 scales and minimums (as GGUF's) keep the overhead at 4 bytes a group of 32 weights:
1.125 bytes a weight, 0.56x bfloat16. The codes are chosen against the rounded float16
scale and minimum, so the rounding of those costs no accuracy beyond the int8 step.

`packed.matmul` runs them in float32 whatever the model dtype (the activations between
matmuls are float32 already): on CPU through jaxcb's native int8 kernel where one can run
(native/matmul.cc: the codes widened and scaled in registers), else through XLA, which
dequantizes to float32 and multiplies as for a plain weight (`layers.dense`).

On GPU and TPU int8 weights take another form (`weight_form`): {"q": int8, "scale": [1, out]},
symmetric, one scale per output channel (w8a16, as fp8's). The codes are converted to the
model dtype inside the dot and the scale multiplies its result, so XLA fuses the conversion
into the matmul and reads one byte a weight. The grouped form cannot fuse there: its scale and
minimum vary along the contracted axis, and XLA materialized the dequantized weights every
step (compiled for v5e x4, a 2-layer Qwen3-8B decode step moved 10.4 GB instead of bfloat16's
0.84). A GGUF file's blocks are therefore requantized per channel on those platforms.

`quantize_params` quantizes every layer matmul weight (the ParamInfos marked `matmul`);
an untied embedding table and output head stay in the model dtype (vLLM's int8 schemes keep
them too: the head's error lands directly on the logits). A tied table (the grouped form,
CPU) gets a quantized head of its own, as llama.cpp's Q8_0 files quantize theirs: the CPU
then keeps only that (packed.embed_tokens reads the tokens' rows from it), where the table
and its copy as the head were, in SmolLM2, 42% of bfloat16's weight bytes; its perplexity
moved by 0.1% (docs/quantization.md). The declarations follow: `q`,
`scale` and `min` keep the weight's logical axes (tensor parallelism splits them as it
split the weight; a split input axis splits whole groups where 32 x TP divides it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.config import QUANTIZATIONS  # "none" (the model dtype), "int8", "fp8"
from jaxcb.models.base import ParamInfo, Params, is_param_info
from jaxcb.models.layers import dense, precision

#: q = code - CODE_OFFSET: the codes 0..255 stored as int8.
CODE_OFFSET = 128
#: The dtype of the scales and minimums (GGUF's).
SCALE_DTYPE = "float16"


def is_quantized(w: Any) -> bool:
    """An int8 weight {"q", "scale", "min"}, or an fp8 or per-channel int8 one {"q", "scale"}."""
    return isinstance(w, dict) and set(w) in ({"q", "scale", "min"}, {"q", "scale"})


#: fp8 weights: e4m3 (vLLM's "fp8"), a scale per output channel in the model dtype.
FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0
#: Per-channel int8 codes: -127..127 (symmetric).
INT8_MAX = 127.0


#: Input rows that share a scale (GGUF's block size): per output channel, every 32 inputs.
GROUP_SIZE = 32


def group_size(num_inputs: int) -> int:
    """GROUP_SIZE where it divides the input axis, else the whole axis (one scale per
    output channel)."""
    return GROUP_SIZE if num_inputs % GROUP_SIZE == 0 else num_inputs


def quantize_int8(w: Any, grid: tuple[Any, Any] | None = None) -> dict[str, np.ndarray]:
    """{"q": int8 w.shape, "scale", "min": float16 [in / G, *w.shape[1:]]} for w [in, ...]
    (host numpy; one scale and minimum per output channel and group of G = group_size(in)
    inputs).

    Without `grid`: the group's range [min, max] spread over the 256 codes, the scale and
    minimum rounded to float16 first and the codes chosen against the rounded values.
    `grid` = (d, m), arrays of w's shape: w was dequantized from blocks whose values are
    d x code + m (GGUF Q8_0 / Q4_0 / Q4_1 as `GGUFFile.block_grid` gives them); where d and m
    are constant over each group, they are the group's scale and minimum and the codes are
    recovered exactly (else the range above)."""
    w32 = np.asarray(w, np.float32)
    g = group_size(w32.shape[0])
    grouped = w32.reshape(w32.shape[0] // g, g, *w32.shape[1:])
    if grid is not None and (found := _grid_codes(grouped, grid)) is not None:
        return found
    lo, hi = grouped.min(axis=1), grouped.max(axis=1)
    scale = ((hi - lo) / 255).astype(np.float16)
    minimum = lo.astype(np.float16)
    return _codes(grouped, scale, minimum)


def _codes(grouped: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> dict[str, np.ndarray]:
    # a scale may be negative: a Q4_0 block's d is its largest-magnitude value / -8
    s32, m32 = scale.astype(np.float32)[:, None], minimum.astype(np.float32)[:, None]
    safe = np.where(s32 != 0, s32, 1.0)
    codes = np.where(s32 != 0, np.rint((grouped - m32) / safe), 0.0)
    q = (np.clip(codes, 0, 255) - CODE_OFFSET).astype(np.int8).reshape(-1, *grouped.shape[2:])
    # C order whatever the weight's (a transposed checkpoint tensor's is Fortran's; a grid's
    # slices are strided): the native kernel's packing views them as bytes
    arrays = {"q": q, "scale": scale, "min": minimum}
    return {k: np.ascontiguousarray(x) for k, x in arrays.items()}


def _grid_codes(grouped: np.ndarray, grid: tuple[Any, Any]) -> dict[str, np.ndarray] | None:
    d, m = (np.asarray(a, np.float32).reshape(grouped.shape) for a in grid)
    if not ((d == d[:, :1]).all() and (m == m[:, :1]).all()):
        return None  # the blocks do not follow the groups (another layout): quantize anew
    scale, minimum = d[:, 0].astype(np.float16), m[:, 0].astype(np.float16)
    if not (np.array_equal(scale, d[:, 0]) and np.array_equal(minimum, m[:, 0])):
        return None
    found = _codes(grouped, scale, minimum)
    if not np.array_equal(dequantize_np(found).reshape(grouped.shape), grouped):
        return None  # codes beyond 0..255, or values off the grid
    return found


def dequantize_np(w: dict[str, np.ndarray]) -> np.ndarray:
    """`dequantize` on the host, in float32."""
    q, scale, minimum = (np.asarray(w[k]) for k in ("q", "scale", "min"))
    groups = scale.shape[0]
    codes = q.reshape(groups, -1, *q.shape[1:]).astype(np.float32) + CODE_OFFSET
    out = codes * scale.astype(np.float32)[:, None] + minimum.astype(np.float32)[:, None]
    return out.reshape(q.shape)


def dequantize(w: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """The weight a quantized one stands for, in `dtype`: computed in float32 and rounded
    once (one elementwise expression XLA can fuse into the consumer's operand)."""
    q, scale, minimum = w["q"], w["scale"], w["min"]
    groups = scale.shape[0]
    codes = q.reshape(groups, q.shape[0] // groups, *q.shape[1:]).astype(jnp.float32)
    out = (codes + CODE_OFFSET) * scale.astype(jnp.float32)[:, None]
    out = out + minimum.astype(jnp.float32)[:, None]
    return out.reshape(q.shape).astype(dtype)


def int8_matmul(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [T, in] @ a quantized [in, ...] weight viewed as [in, out]: float32 [T, out], the
    weight dequantized to float32 (exactly: every code times a float16 scale) and multiplied
    as `layers.dense` does, as the native int8 kernel does in registers (w8a32 on CPU)."""
    weight = dequantize(w, jnp.float32)
    return dense(x, weight.reshape(weight.shape[0], -1))


def quantize_int8_channel(w: Any) -> dict[str, np.ndarray]:
    """{"q": int8 w.shape, "scale": [1, *w.shape[1:]] in w's dtype}: w [in, ...] with one
    symmetric scale per output channel, its largest magnitude -> 127, the codes chosen
    against the rounded scale (the GPU/TPU form of int8; `channel_matmul` runs it)."""
    w = np.asarray(w)
    w32 = w.astype(np.float32)
    amax = np.abs(w32).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(w.dtype)
    codes = np.clip(np.rint(w32 / scale.astype(np.float32)), -INT8_MAX, INT8_MAX)
    return {"q": codes.astype(np.int8), "scale": scale}


def quantize_fp8(w: Any) -> dict[str, np.ndarray]:
    """{"q": float8_e4m3fn w.shape, "scale": [1, *w.shape[1:]] in w's dtype}: w [in, ...]
    with one scale per output channel, its largest magnitude -> 448 (e4m3's largest), the
    codes chosen against the rounded scale."""
    w = np.asarray(w)
    w32 = w.astype(np.float32)
    amax = np.abs(w32).max(axis=0, keepdims=True)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(w.dtype)
    codes = np.clip(w32 / scale.astype(np.float32), -FP8_MAX, FP8_MAX)
    return {"q": codes.astype(jnp.dtype(FP8_DTYPE)), "scale": scale}


def channel_matmul(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """x [T, in] @ an fp8 or per-channel int8 [in, ...] weight viewed as [in, out]: float32
    [T, out]. The codes are converted to the scale's dtype (the model's) inside the dot and
    the per-channel scale applied to its result, which XLA fuses on GPU and TPU (the weight
    is read at one byte a weight)."""
    q, scale = w["q"], w["scale"]
    # The input axis contracted alone, the output axes kept: merging them first ([H, 2, I]
    # -> [H, 2 I]) gathered a tensor-parallel gate/up weight whole on every chip, its I
    # axis split over them (Qwen3-8B int8 on v5e x4: an all-gather of every layer's).
    dtype = scale.dtype
    y = jnp.tensordot(
        x.astype(dtype),
        q.astype(dtype),
        axes=1,
        preferred_element_type=jnp.float32,
        precision=precision(dtype),
    )  # [T, *out]
    return (y * scale[0].astype(jnp.float32)).reshape(x.shape[0], -1)


def quantized_matmul(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """`int8_matmul` (grouped int8) or `channel_matmul` (fp8, per-channel int8)."""
    return int8_matmul(x, w) if "min" in w else channel_matmul(x, w)


def weight_form(quantization: str, platform: str) -> str:
    """How `quantization`'s weights are held on `platform`: "none", "int8" (groups of 32
    with a minimum: CPU, where the native kernels run them and GGUF blocks load exactly),
    "int8_channel" (GPU/TPU: per-channel, fused into the dot by XLA; see the module doc) or
    "fp8"."""
    _check(quantization)
    return "int8_channel" if quantization == "int8" and platform != "cpu" else quantization


def check_stored(quantization: str, platform: str) -> None:
    """One-line ValueError for a checkpoint stored quantized in a form `platform` cannot run
    well: grouped int8 (convert_checkpoint.py's, the CPU form) on GPU/TPU, where XLA would
    materialize the dequantized weights every step instead of fusing them into the dot."""
    if quantization == "int8" and platform != "cpu":
        raise ValueError(
            f"this checkpoint stores quantization='int8' weights in groups of 32 (the CPU "
            f"form), which {platform} would dequantize every step: convert it without "
            "--quantization and pass quantization int8 at load (per-channel there)"
        )


def check_tensor_parallel(infos: Params, rules: dict[str, Any], tensor_parallel_size: int) -> None:
    """One-line ValueError if tensor parallelism would split a quantization group: an int8
    weight split along its input axis splits its groups of 32 inputs among the devices,
    which must then hold whole groups (`rules`: logical axis -> mesh axis, None replicated)."""
    if tensor_parallel_size <= 1:
        return
    weights = dict(infos["layers"][0])
    if "lm_head" in infos:
        weights["lm_head"] = infos["lm_head"]
    for name, info in weights.items():
        if not (isinstance(info, dict) and "min" in info):
            continue
        groups = info["scale"].shape[0]
        if rules.get(info["scale"].axes[0]) is not None and groups % tensor_parallel_size:
            raise ValueError(
                f"quantization='int8' with tensor_parallel_size={tensor_parallel_size} would "
                f"split a group of {info['q'].shape[0] // groups} inputs of {name} "
                f"({info['q'].shape[0]} inputs, {groups} groups): use a tensor_parallel_size "
                f"that divides {groups}"
            )


def _check(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")


def _quantized_info(info: ParamInfo, form: str) -> dict[str, ParamInfo]:
    if form in ("fp8", "int8_channel"):  # a scale per output channel: never split on inputs
        return {
            "q": ParamInfo(info.shape, info.axes, matmul=True, dtype=_CHANNEL_CODES[form]),
            "scale": ParamInfo((1, *info.shape[1:]), ("embed", *info.axes[1:])),
        }
    groups = info.shape[0] // group_size(info.shape[0])
    return {
        "q": ParamInfo(info.shape, info.axes, matmul=True, dtype="int8"),
        "scale": ParamInfo((groups, *info.shape[1:]), info.axes, dtype=SCALE_DTYPE),
        "min": ParamInfo((groups, *info.shape[1:]), info.axes, dtype=SCALE_DTYPE),
    }


_CHANNEL_CODES = {"fp8": FP8_DTYPE, "int8_channel": "int8"}


def quantized_infos(infos: Params, quantization: str, platform: str = "cpu") -> Params:
    """The declarations of `quantize_params`' result (for abstract params: runtime/aot.py)."""
    form = weight_form(quantization, platform)
    if form == "none":
        return infos
    infos = dict(infos)
    infos["layers"] = [
        {
            k: _quantized_info(v, form) if is_param_info(v) and v.matmul else v
            for k, v in layer.items()
        }
        for layer in infos["layers"]
    ]
    if form == "int8" and "lm_head" not in infos and "embed" in infos:  # a tied table: as head
        infos = quantized_head_infos(infos, quantization, platform)
    return infos


def quantize_params(
    params: Params,
    infos: Params,
    quantization: str,
    grids: Params | None = None,
    platform: str = "cpu",
) -> tuple[Params, Params]:
    """(params, infos) with every layer matmul weight quantized in `weight_form(quantization,
    platform)` (see the module doc); unchanged for "none". An untied output head and the
    embedding table are left as they are, but for a head stored in GGUF blocks; a tied table
    gets a quantized head (params["lm_head"], [H, V]) in the grouped form. `grids`: {"layers":
    [{name: (d, m)}], "lm_head": (d, m)} for weights dequantized from GGUF blocks
    (loader.LoadedModel.block_grids), held to their blocks exactly in the grouped form; with
    a head's grid, params["lm_head"] ([H, V]: the loader's float32 copy of a tied table)
    becomes an int8 weight too. The per-channel forms ignore the grids."""
    form = weight_form(quantization, platform)
    new_infos = quantized_infos(infos, quantization, platform)
    if form == "none":
        return params, infos
    params = dict(params)
    layer_grids = (grids or {}).get("layers") or [{}] * len(params["layers"])

    def quantize(w: Any, grid: Any) -> dict[str, np.ndarray]:
        if form == "int8":
            return quantize_int8(w, grid)
        return quantize_fp8(w) if form == "fp8" else quantize_int8_channel(w)

    params["layers"] = [
        {k: quantize(w, grid.get(k)) if is_param_info(info[k]) and info[k].matmul else w
         for k, w in layer.items()}
        for layer, info, grid in zip(params["layers"], infos["layers"], layer_grids, strict=True)
    ]  # fmt: skip
    if form == "int8" and grids and "lm_head" in grids and "lm_head" in params:
        # A head stored in GGUF blocks (a Q8_0 table, say): as the file has it, not rounded.
        params["lm_head"] = quantize_int8(params["lm_head"], grids["lm_head"])
        new_infos = quantized_head_infos(new_infos, quantization, platform)
    elif form == "int8" and "lm_head" not in params and "embed" in params:
        # A tied table: quantized as the head, which the CPU keeps alone (packed.embed_tokens).
        params["lm_head"] = quantize_int8(np.asarray(params["embed"], np.float32).T)
    return params, new_infos


def quantized_head_infos(infos: Params, quantization: str, platform: str = "cpu") -> Params:
    """`infos` with an output head quantized as `quantize_params` quantizes one stored in GGUF
    blocks ([H, V], the tied table's shape transposed where the model ties it): for params
    that hold such a head (restored from a checkpoint converted so)."""
    h, v = infos["embed"].shape[::-1]
    info = ParamInfo((h, v), ("embed", "vocab"), matmul=True)
    return {**infos, "lm_head": _quantized_info(info, weight_form(quantization, platform))}


def weight_bytes(params: Params) -> int:
    """Bytes of a params pytree (quantized weights at their stored size)."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))
