"""The params as the CPU runs them, prepared once at load on the host: which matmul path
`kernels.matmul` names (`matmul_backend`: one of jaxcb's native CPU kernels, or XLA) and why
each other kernel is not the one in use (`matmul_report`), then the weights packed for that
kernel and the embedding table stored as the CPU gathers it fastest (`prepare_cpu_params`).
packed.py's dispatch runs the forward's matmuls over what this leaves ({kernel: packed}
weights, a table of raw bf16 bits, an untied LM head and its greedy screen).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb import native
from jaxcb.models.base import ParamInfo, Params
from jaxcb.models.quant import is_quantized


def matmul_backend(name: str, *, dtype: Any, tensor_parallel_size: int) -> str:
    """The matmul path for `kernels.matmul` = name: one of jaxcb's native CPU kernels over
    packed weights (jaxcb.native.PACKED_MATMULS: "amx", "avx512_bf16" or "avx2_bf16" for
    bfloat16 weights, "avx512" or "avx2" for float32 ones, each on a CPU with its ISA; one
    device per replica) or "xla". "auto" picks the first native kernel that can run, else
    xla; a native kernel named where it cannot run is a ValueError saying why."""
    if name == "xla":
        return name
    if name == "auto":
        return next(
            (k for k in native.PACKED_MATMULS if not _cannot_run(k, dtype, tensor_parallel_size)),
            "xla",
        )
    if why := _cannot_run(name, dtype, tensor_parallel_size):
        raise ValueError(f"kernels.matmul={name!r} cannot run: " + "; ".join(why))
    return name


def matmul_report(
    chosen: str,
    *,
    requested: str,
    dtype: Any,
    tensor_parallel_size: int,
    quantization: str = "none",
) -> dict[str, str]:
    """Each native matmul kernel with why it is not the one in use (the one in use: "in
    use"): what stats() and the start-up log say. Kernels that `auto` would only have tried
    after the chosen one are not probed (that would build their library for nothing)."""
    order = list(native.PACKED_MATMULS)
    report = {}
    for kernel in order:
        if kernel == chosen:
            report[kernel] = "in use"
        elif requested != "auto":
            report[kernel] = f"kernels.matmul={requested}"
        elif chosen in order and order.index(kernel) > order.index(chosen):
            report[kernel] = f"auto prefers {chosen}"
        else:
            report[kernel] = "; ".join(_cannot_run(kernel, dtype, tensor_parallel_size))
    report[native.INT8_MATMUL.name] = _int8_report(chosen, quantization, tensor_parallel_size)
    return report


def _int8_report(chosen: str, quantization: str, tensor_parallel_size: int) -> str:
    if quantization == "none":
        return "no quantized weights (quantization=none)"
    if chosen == "xla":
        return "the matmuls run on XLA (it dequantizes the int8 weights)"
    why = _cannot_run(native.INT8_MATMUL.name, jnp.int8, tensor_parallel_size)
    return "; ".join(why) + " (XLA dequantizes them)" if why else "in use for the int8 weights"


def _cannot_run(kernel: str, dtype: Any, tensor_parallel_size: int) -> list[str]:
    spec = native.ALL_PACKED[kernel]
    found = []
    if jax.default_backend() != "cpu":
        found.append(f"the platform is {jax.default_backend()}, not cpu")
    if jnp.dtype(dtype) != jnp.dtype(spec.dtype):
        found.append(f"the weights are {jnp.dtype(dtype).name}, not {jnp.dtype(spec.dtype).name}")
    if tensor_parallel_size > 1:
        found.append("tensor parallelism shards the weights (the kernel is per device)")
    if not found and (why := spec.unavailable_reason()):
        found.append(why)
    return found


def prepare_cpu_params(
    params: Params,
    infos: Params,
    *,
    pack: str | None,
    greedy_screen: bool,
    platform: str | None = None,
    tied: bool = False,
) -> tuple[Params, Params]:
    """The params (and their declarations) as the CPU runs them best; unchanged elsewhere
    (`platform`: where the step will run, default jax's backend; a compile for an absent
    accelerator names it).

    - A bfloat16 embedding table is stored as raw uint16 bits. XLA's CPU backend has no
      bfloat16 gather: looking up a few rows converted the whole table to float32 in every
      step (23 ms for 32000 x 512); gathering uint16 rows and viewing them as bfloat16 costs
      nothing. Tied embeddings then keep a bf16 copy as lm_head.
    - `pack`: a native matmul kernel (see `matmul_backend`); every matmul weight of its dtype
      that fits its layout becomes {pack: packed}, and a float32 lm_head packed for a float32
      kernel gains its bf16 screen (`greedy_screen`). A stack of expert weights
      (ParamInfo.experts, [E, in, ...]) of its dtype becomes {pack: E packed matrices} for
      the grouped kernel (native.pack_experts). Quantized weights (models/quant.py)
      become {"int8": packed} where the int8 kernel runs (else XLA dequantizes them).
    - `tied` (the embeddings are tied to the head) with a quantized head (a GGUF file's Q8_0
      or Q4 table): the table is left out and `embed_tokens` reads the head's columns. The
      table in the model dtype beside the int8 head was a third of a Q8_0 SmolLM2's weights.
    """
    if (platform or jax.default_backend()) != "cpu":
        return params, infos
    if tied and is_quantized(params.get("lm_head")) and "embed" in params:
        params, infos = dict(params), dict(infos)
        del params["embed"], infos["embed"]
    else:
        params, infos = _embed_as_bits(params, infos)
    if pack:
        params, infos = _untie_lm_head(params, infos)
        params = _pack_weights(params, infos, pack, greedy_screen=greedy_screen)
    return params, infos


def _untie_lm_head(params: Params, infos: Params) -> tuple[Params, Params]:
    """A tied embedding's transposed copy as lm_head, so the native kernel (and its greedy
    screen) runs the output head: XLA's dot over the embedding table ran SmolLM2's float32
    head (49152 x 576) at a third of the memory bandwidth, 6.9 of a 19 ms decode step."""
    if "lm_head" in params:
        return params, infos
    params, infos = dict(params), dict(infos)
    params["lm_head"] = np.ascontiguousarray(np.asarray(params["embed"]).T)
    table = infos["embed"]
    infos["lm_head"] = ParamInfo(table.shape[::-1], table.axes[::-1], matmul=True)
    return params, infos


def _embed_as_bits(params: Params, infos: Params) -> tuple[Params, Params]:
    embed = params["embed"]
    if embed.dtype != jnp.bfloat16:
        return params, infos
    # Arrays restored from an orbax checkpoint are on the (CPU) devices: read them back.
    params, infos = _untie_lm_head(dict(params), dict(infos))
    params["embed"] = np.asarray(embed).view(np.uint16)
    return params, infos


def _pack_weights(params: Params, infos: Params, kernel: str, *, greedy_screen: bool) -> Params:
    spec = native.PACKED_MATMULS[kernel]
    int8 = native.INT8_MATMUL
    int8_runs = int8.available()

    def pack(w: Any, info: Any) -> Any:
        if is_quantized(w):  # int8: to its kernel where it runs and fits; else (fp8) XLA
            shape = (w["q"].shape[0], int(np.prod(w["q"].shape[1:])))
            grouped = "min" in w and w["scale"].shape[0] * 32 == shape[0]  # int8, groups of 32
            if int8_runs and grouped and int8.can_pack(shape):
                codes = native.INT4_MATMUL if native.fits_int4(w) else int8  # Q4 blocks: 4 bits
                return {codes.name: codes.pack(w)}
            return w
        if info.experts:  # [E, in, ...]: a stack of matrices for the grouped kernel
            w3 = np.asarray(w)
            if w3.dtype != jnp.dtype(spec.dtype) or not native.can_pack_experts(kernel, w3.shape):
                return w
            return {kernel: native.pack_experts(kernel, w3)}
        if not info.matmul:
            return w
        w2 = np.asarray(w)
        w2 = w2.reshape(w2.shape[0], -1)
        if w2.dtype != jnp.dtype(spec.dtype) or not spec.can_pack(w2.shape):
            return w
        return {kernel: spec.pack(w2)}

    packed = jax.tree_util.tree_map(pack, params, infos, is_leaf=is_quantized)
    lm_head = packed.get("lm_head")
    if (
        greedy_screen
        and jnp.dtype(spec.dtype) == jnp.float32
        and isinstance(lm_head, dict)
        and native.can_pack_bf16(np.shape(params["lm_head"]))
    ):
        packed["lm_head_screen"] = native.pack_argmax_screen(np.asarray(params["lm_head"]))
    return packed
