"""LoRA adapters' term on the native kernel (lora.cc): each token row through its own slot's
A and B only, added in place to the base matmul's output, read from the slot arrays' stacks
over the layers (jaxcb/lora.py's layout) without slicing them.

XLA's forms of the same term are a masked matmul pair over every slot (N x the reads and
multiply-adds of one adapter) under a branch that skips it when no row has an adapter; the
kernel does a row's own slot's work and nothing for a base row, so it needs no branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.native.build import (
    LORA_ADD_BF16_TARGET,
    LORA_ADD_F32_TARGET,
    NativeBuildError,
    active_level,
    load,
    registered_target,
)

_TARGETS = {
    jnp.dtype(jnp.float32): LORA_ADD_F32_TARGET,
    jnp.dtype(jnp.bfloat16): LORA_ADD_BF16_TARGET,
}


def can_add_lora(dtype: Any) -> bool:
    """Whether the kernel runs here for slot arrays of `dtype` (float32 or bfloat16, on a CPU
    with AVX2 or better whose library built)."""
    if jnp.dtype(dtype) not in _TARGETS:
        return False
    try:
        return load().v16
    except (NativeBuildError, OSError):
        return False


def lora_add(
    y: jax.Array,  # f32[M, N]: the base matmul's output
    x: jax.Array,  # [M, K]: its input rows
    slots: jax.Array,  # i32[M]: each row's slot (0: none; s: index s - 1 of the slot axis)
    rows: Any,  # i32 scalar: the real rows (the rest: padding, left as they are)
    layer: Any,  # int or i32 scalar: the layer of the stacks to read
    a: jax.Array,  # [L, K, P, N, R]: every layer's A of the weight's P parts
    bs: Sequence[jax.Array],  # P x [L, N, R, *cols_p]: every layer's B of each part
    runs: Sequence[tuple[int, int, int]],  # each part's (run, stride, offset) in y's columns
    norm: tuple[jax.Array, float] | None = None,  # (weight [K], eps): x's rows RMS-normed first
) -> jax.Array:
    """y plus each real row's adapter term (f32[M, N]; y's buffer, updated in place).

    `norm`: the layer's input norm the base matmul's kernel applies in its call (a Normed
    input): the kernel norms the adapter rows alone, so a step without them norms nothing.

    Part p's column c of B lands in y's column offset + (c // run) * stride + c % run (a
    part interleaved with the others, as q with k and v per KV head); the term is rounded as
    XLA's dots of the same arrays round it (x, then x @ A, to the slot arrays' dtype)."""
    if len(bs) != len(runs) or not 1 <= len(bs) <= 3:
        raise ValueError(f"1 to 3 parts, each with its runs: got {len(bs)} and {len(runs)}")
    target = registered_target(_TARGETS[jnp.dtype(a.dtype)], active_level())
    flat = [b.reshape(*b.shape[:3], -1) for b in bs]
    flat += [flat[0]] * (3 - len(flat))  # (unused parts: the kernel reads `parts` of them)
    weight, eps = norm if norm is not None else (jnp.zeros((0,), jnp.float32), 0.0)
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct(y.shape, jnp.float32), input_output_aliases={0: 0}
    )
    return call(
        y.astype(jnp.float32),
        x.astype(jnp.float32),
        slots.astype(jnp.int32),
        jnp.reshape(jnp.asarray(rows, jnp.int32), (1,)),
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        a,
        *flat,
        weight,
        layout=np.asarray(runs, np.int64).reshape(-1),
        eps=np.float32(eps),
    )
