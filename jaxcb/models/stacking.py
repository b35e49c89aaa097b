"""Layers stacked over their count, and the forward's loop over them.

A model's layer weights are not one array each per layer: every run of consecutive layers
whose weights have the same structure, shapes and dtypes is one array per weight with a
leading layer axis, [n, ...] (`stack_layers`, once, when the runner takes the params): a
dense model is one run; a mixture of experts with dense first layers two; a GGUF file that
stores some layers' matrices in other blocks splits where they change. So the step takes a
handful of weight arrays whatever the layer count, and the forward can loop over a run with
`jax.lax.scan`: the layer is traced and compiled once, not once per layer (`run_layers`).

Inside the loop a layer reads its weights by index: the native CPU kernels take the whole
stack and the layer's index and read it in place (packed.LayerWeight); anything else takes
its slice (XLA fuses a slice of a stack into the op that reads it on accelerators).

Layers that differ in what the forward does with them (a sliding window or not: Gemma's
local and global layers, Qwen's max_window_layers) are scanned in repeating groups: the scan
body holds one period of the pattern (Gemma 2: a local and a global layer; Gemma 3: five
local, one global), so the loop never falls back to one copy of the layer per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.models.base import ParamInfo, Params, is_param_info
from jaxcb.models.packed import at_layer

#: The longest repeating group of layers a scan body holds (Gemma 3's is 6).
MAX_PERIOD = 8


def stack_layers(params: Params, infos: Params) -> tuple[Params, Params]:
    """params["layers"] (a list of per-layer dicts, as the loaders write it) as a list of
    runs, each one dict of arrays stacked over the run's layers; infos["layers"] to match
    (each ParamInfo with a leading "layers" axis). Leaves may be numpy arrays, jax arrays or
    ShapeDtypeStructs (a compile for an absent target). New dicts: the arguments are not
    changed."""
    layers, layer_infos = params["layers"], infos["layers"]
    if len(layers) != len(layer_infos):
        raise ValueError(f"{len(layers)} layers of params but {len(layer_infos)} declared")
    runs, run_infos, first = [], [], 0
    for count in layer_runs(layers):
        run = layers[first : first + count]
        runs.append(jax.tree_util.tree_map(lambda *xs: _stack(xs), *run))
        stacked = functools.partial(_stacked_info, count=count)
        run_infos.append(jax.tree_util.tree_map(stacked, layer_infos[first], is_leaf=is_param_info))
        first += count
    return {**params, "layers": runs}, {**infos, "layers": run_infos}


def layer_runs(layers: Sequence[Params]) -> list[int]:
    """The lengths of the runs of consecutive layers whose params have the same tree
    structure, shapes and dtypes."""
    lengths: list[int] = []
    previous = None
    for layer in layers:
        leaves, treedef = jax.tree_util.tree_flatten(layer)
        signature = (treedef, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves))
        if signature == previous:
            lengths[-1] += 1
        else:
            lengths.append(1)
        previous = signature
    return lengths


def _stack(xs: Sequence[Any]) -> Any:
    first = xs[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *first.shape), first.dtype)
    if isinstance(first, jax.Array):  # restored onto the devices (orbax)
        return jnp.stack(xs)
    return np.stack([np.asarray(x) for x in xs])


def _stacked_info(info: ParamInfo, count: int) -> ParamInfo:
    return ParamInfo(
        (count, *info.shape), ("layers", *info.axes), info.matmul, info.dtype, info.experts
    )


def run_length(stack: Params) -> int:
    """The layers a stacked run holds (its arrays' leading axis)."""
    return jax.tree_util.tree_leaves(stack)[0].shape[0]


def segments(kinds: Sequence[Hashable]) -> list[tuple[int, int, int]]:
    """(start, count, period) pieces of a run of layers whose static `kinds` (what makes the
    forward trace a layer differently) repeat with `period` over `count` layers, count a
    multiple of period: from the start, the piece covering the most layers with a period of
    at most MAX_PERIOD that repeats at least twice (the shortest period on a tie)."""
    out: list[tuple[int, int, int]] = []
    i, n = 0, len(kinds)
    while i < n:
        best_period, best_count = 1, 1
        for period in range(1, min(MAX_PERIOD, n - i) + 1):
            k = i + period
            while k < n and kinds[k] == kinds[k - period]:
                k += 1
            count = (k - i) // period * period
            if count > best_count and (period == 1 or count >= 2 * period):  # (repeated)
                best_period, best_count = period, count
        out.append((i, best_count, best_period))
        i += best_count
    return out


LayerFn = Callable[..., Any]


def run_layers(
    layers: Sequence[Params],
    carry: Any,
    layer_fn: LayerFn,
    *,
    kinds: Sequence[Hashable],
    scan: bool,
    lora: Any = None,
) -> Any:
    """carry after every layer in order: `layer_fn(layer, carry, index, kind_index)`
    with the layer's params (`at_layer`), its index (an int, or traced inside a scan: for
    what may vary, such as its pages), and the index of a layer of the same kind (an int:
    for what the trace depends on, such as its sliding window). `scan`: `layers` are the
    stacked runs (`stack_layers`) and each run's `segments` by `kinds` (each layer's static
    kind) are scanned; else `layers` are the loaders' per-layer params, unrolled
    (`unrolled`).

    `lora`: the token rows' LoRA adapters (jaxcb/lora.py's LoraRows), handed to every
    layer_fn call as `lora=`; None: not passed."""
    if lora is not None:
        if not scan:
            raise ValueError("LoRA adapters need the layers scanned (kernels.scan_layers true)")
        layer_fn = functools.partial(layer_fn, lora=lora)
    if not scan:
        return unrolled(layers, carry, layer_fn, kinds=kinds)
    first = 0
    for stack in layers:
        n = run_length(stack)
        for start, count, period in segments(kinds[first : first + n]):
            if count == period:
                for j in range(start, start + count):
                    carry = layer_fn(at_layer(stack, j), carry, first + j, first + j)
                continue

            def body(
                carry: Any, group: jax.Array, stack=stack, first=first, start=start, period=period
            ) -> tuple[Any, None]:
                for j in range(period):
                    local = start + group * period + j
                    carry = layer_fn(
                        at_layer(stack, local), carry, first + local, first + start + j
                    )
                return carry, None

            groups = jnp.arange(count // period, dtype=jnp.int32)
            carry, _ = jax.lax.scan(body, carry, groups)
        first += n
    return carry


def unrolled(
    layers: Sequence[Params], carry: Any, layer_fn: LayerFn, *, kinds: Sequence[Hashable]
) -> Any:
    """The layers one after another, each its own copy in the program, but traced once per
    kind of layer, not once per layer: `carry` is (x, the per-layer pools, a list), and each
    layer runs as one nested jit of (its params, x, its own pool), which jax traces and lowers
    once for every layer of the same shapes and kind (XLA inlines the calls, so the compiled
    program is the unrolled one). Tracing a 32-layer model's bucket for an H100 took ~5 ms a
    layer before."""
    x, pools = carry
    first_of_kind = {kind: kinds.index(kind) for kind in kinds}

    def one_layer(layer: Params, x: Any, pool: Any, kind_index: int) -> tuple[Any, Any]:
        x, (pool,) = layer_fn(layer, (x, [pool]), 0, kind_index)  # (its pool at index 0)
        return x, pool

    traced_once = jax.jit(one_layer, static_argnums=3)
    pools = list(pools)
    for i, layer in enumerate(layers):
        x, pools[i] = traced_once(layer, x, pools[i], first_of_kind[kinds[i]])
    return x, pools
