"""Many LoRA adapters in one step: the slot arrays, what an adapter writes into them, and
the batched delta the layers add (docs/lora.md).

**Slots.** With LoRA enabled, every LoRA-able weight of every layer (the fused q/k/v
`wqkv`, `wo`, `w_gate_up` and `w_down`, those the family has as plain matrices: a mixture of
experts adapts its attention) gains a pair of arrays in the layer's params, under "lora":

    a  [in, P, N, R]      the A matrices ([in, r]) of the weight's P parts (q, k, v of wqkv;
                          gate, up of w_gate_up; one part otherwise) for each of the
                          N = max_loras slots, the rank zero-padded to R = max_lora_rank
    b  P x [N, R, *out_p] each part's B ([r, out], times the adapter's scale) in the base
                          weight's output layout (q [Hkv, G, D], k and v [Hkv, 1, D], gate
                          and up [1, I], o and down [H])

Loading an adapter into a slot writes that slot of the arrays (`slot_values` makes the
values; the runner writes them): shapes never change and nothing is recompiled. Slot s of
the step input (StepInput.lora_slots, one per token row) is index s - 1 of the N axis; 0 is
the base model.

**The step.** Each token row's slot comes in as `LoraRows` (`lora_rows`), and each
adaptable matmul's output gets every row's adapter term added (`add_adapters`). Where the
base weight runs on a native CPU kernel, so does the term (native.lora_add, jaxcb/native/
lora.cc): rows grouped by slot, each group through its own slot's A then B only, added in
place; a base row or a padding row costs nothing. Elsewhere (accelerators, a CPU without the
kernels) XLA computes `lora_delta` for all rows at once: u = x @ a (all slots' A, [T, P, N,
R]), masked to each row's own slot (one-hot [T, N]), then per part u @ b over the (slot,
rank) axes, laid out as the base weight's output; it sits under a lax.cond on whether any
row has an adapter, so a step of base rows reads no slot array. `column_runs` says where each
part's columns fall in the weight's output, for both forms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb import native
from jaxcb.config import LoraConfig
from jaxcb.models.base import ModelSpec, ParamInfo, Params, is_param_info
from jaxcb.models.layers import dense
from jaxcb.models.loading.peft import Adapter
from jaxcb.models.packed import LayerSlots, Normed
from jaxcb.models.weights import ModelLoadError

#: A LoRA-able weight -> (the axis of its output shape, after the input axis, that its parts
#: are stacked on, None for one part; the Hugging Face module of each part).
LORA_WEIGHTS: dict[str, tuple[int | None, tuple[str, ...]]] = {
    "wqkv": (1, ("q_proj", "k_proj", "v_proj")),  # [H, Hkv, G + 2, D]: G, 1, 1 of axis G + 2
    "wo": (None, ("o_proj",)),
    "w_gate_up": (0, ("gate_proj", "up_proj")),  # [H, 2, I]
    "w_down": (None, ("down_proj",)),
}
#: Hugging Face modules that fuse several parts (Phi-3): their B stacks the parts' rows, and
#: their one A serves every part.
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
#: Logical axes of the slot arrays (runtime/sharding.py replicates them; a's input axis and
#: b's output axes are the base weight's, sharded as it is).
LORA_AXES = ("lora_parts", "lora_slots", "lora_rank")


def adaptable_weights(layer_infos: Params) -> list[str]:
    """The LoRA-able weights a layer declares (its family's `param_infos` layer) as plain
    matrices."""
    return [
        name
        for name in LORA_WEIGHTS
        if isinstance(layer_infos.get(name), ParamInfo)
        and layer_infos[name].matmul
        and not layer_infos[name].experts
    ]


def _part_sizes(name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The size of each part along the stacking axis of the weight's output."""
    if name == "wqkv":
        return (spec.group_size, 1, 1)
    return (1,) * len(LORA_WEIGHTS[name][1])


def _part_shapes(name: str, info: ParamInfo, spec: ModelSpec) -> list[tuple[int, ...]]:
    """Each part's output shape (the base weight's output shape, its stacking axis cut)."""
    out = info.shape[1:]
    axis = LORA_WEIGHTS[name][0]
    if axis is None:
        return [out]
    return [(*out[:axis], size, *out[axis + 1 :]) for size in _part_sizes(name, spec)]


def lora_param_infos(layer_infos: Params, spec: ModelSpec, max_loras: int, max_rank: int) -> Params:
    """One layer's "lora" entry of the params' declaration: {weight: {"a": ..., "b": [...]}}."""
    out: Params = {}
    for name in adaptable_weights(layer_infos):
        info = layer_infos[name]
        parts = _part_shapes(name, info, spec)
        a = ParamInfo((info.shape[0], len(parts), max_loras, max_rank), (info.axes[0], *LORA_AXES))
        b = [
            ParamInfo((max_loras, max_rank, *shape), (*LORA_AXES[1:], *info.axes[1:]))
            for shape in parts
        ]
        out[name] = {"a": a, "b": b}
    return out


def with_lora_slots(
    config: LoraConfig,
    params: Params,
    infos: Params,
    base_infos: Params,
    spec: ModelSpec,
    dtype: Any,
) -> tuple[Params, Params]:
    """params and infos as the runner takes them under `config` (the engine's `lora`
    section): with every layer's empty slot arrays (`add_lora_slots`; `base_infos`: the
    family's `param_infos`) when LoRA is enabled, else as they are. Start-up
    (runtime/setup.py) and the compile for an absent target (runtime/aot.py) both take
    theirs from here."""
    if not config.enable_lora:
        return params, infos
    return add_lora_slots(
        params,
        infos,
        base_infos,
        spec,
        dtype,
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
    )


def add_lora_slots(
    params: Params,
    infos: Params,
    base_infos: Params,
    spec: ModelSpec,
    dtype: Any,
    *,
    max_loras: int,
    max_rank: int,
) -> tuple[Params, Params]:
    """params and infos with every layer's empty (zero) slot arrays added under "lora"
    (`base_infos`: the family's `param_infos`, unquantized; params may hold host arrays or
    ShapeDtypeStructs, for a compile-only runner). New dicts: the arguments are not changed."""
    layers, layer_infos = [], []
    for layer, info, base in zip(
        params["layers"], infos["layers"], base_infos["layers"], strict=True
    ):
        lora = lora_param_infos(base, spec, max_loras, max_rank)
        abstract = any(
            isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(layer)
        )
        make = (
            (lambda i: jax.ShapeDtypeStruct(i.shape, dtype))
            if abstract
            else (lambda i: np.zeros(i.shape, dtype))
        )
        lora_arrays = jax.tree_util.tree_map(make, lora, is_leaf=is_param_info)
        layers.append({**layer, "lora": lora_arrays})
        layer_infos.append({**info, "lora": lora})
    return {**params, "layers": layers}, {**infos, "layers": layer_infos}


def slot_values(
    adapter: Adapter, spec: ModelSpec, base_infos: Params, max_rank: int, dtype: Any
) -> list[Params]:
    """What `adapter` writes into a slot, layer by layer: {weight: {"a": [in, P, R], "b":
    [[R, *out_p] per part]}} of `dtype` (zeros where it adapts nothing); ModelLoadError (one
    line) if it does not fit the base model: a module the family does not adapt, a layer it
    lacks, shapes that differ from the base weights', a rank above `max_rank`."""
    where = f"LoRA adapter {adapter.path}"
    layer_infos = base_infos["layers"]
    part_of = {m: (w, p) for w, (_, modules) in LORA_WEIGHTS.items() for p, m in enumerate(modules)}
    adapted = {w for info in layer_infos for w in adaptable_weights(info)}
    known = sorted(
        {m for m, (w, _) in part_of.items() if w in adapted}
        | {m for m, parts in FUSED_MODULES.items() if part_of[parts[0]][0] in adapted}
    )
    values = []
    for layer_info in layer_infos:
        values.append(
            {
                name: {
                    "a": np.zeros((layer_info[name].shape[0], len(shapes), max_rank), np.float32),
                    "b": [np.zeros((max_rank, *s), np.float32) for s in shapes],
                }
                for name in adaptable_weights(layer_info)
                for shapes in [_part_shapes(name, layer_info[name], spec)]
            }
        )
    for (layer, module), pair in adapter.pairs.items():
        if module not in known:
            raise ModelLoadError(
                f"{where} adapts {module!r}, which jaxcb does not adapt in "
                f"{spec.architecture} (it adapts {', '.join(known)})"
            )
        if not 0 <= layer < spec.num_layers:
            raise ModelLoadError(
                f"{where} adapts layer {layer}; the base model has {spec.num_layers}"
            )
        parts = FUSED_MODULES.get(module, (module,))
        name = part_of[parts[0]][0]
        if name not in values[layer]:
            raise ModelLoadError(
                f"{where} adapts layer {layer} {module}, a mixture of experts' there"
            )
        info = layer_infos[layer][name]
        shapes = _part_shapes(name, info, spec)
        indices = [part_of[m][1] for m in parts]
        sizes = [math.prod(shapes[i]) for i in indices]
        expected = (sum(sizes), info.shape[0])
        got = (pair.b.shape[0], pair.a.shape[1])
        if got != expected:
            raise ModelLoadError(
                f"{where}: layer {layer} {module} maps {got[1]} inputs to {got[0]} outputs; "
                f"the base model's maps {expected[1]} to {expected[0]} (another base model?)"
            )
        r = pair.rank
        if r > max_rank:
            raise ModelLoadError(
                f"{where} has rank {r} (layer {layer} {module}), above max_lora_rank={max_rank}"
            )
        a = np.asarray(pair.a, np.float32).T  # [in, r]
        b = np.asarray(pair.b, np.float32).T * np.float32(pair.scale)  # [r, out]
        slot = values[layer][name]
        for i, rows in zip(indices, np.split(b, np.cumsum(sizes)[:-1], axis=1), strict=True):
            slot["a"][:, i, :r] = a
            slot["b"][i][:r] = rows.reshape(r, *shapes[i])
    return [jax.tree_util.tree_map(lambda x: x.astype(dtype), layer) for layer in values]


def stack_slot_values(values: Sequence[Params], run_lengths: Sequence[int]) -> list[Params]:
    """`slot_values`' per-layer values stacked as the params' runs of layers are
    (models/stacking.py): one tree per run, each array with a leading layer axis."""
    runs, first = [], 0
    for n in run_lengths:
        runs.append(jax.tree_util.tree_map(lambda *xs: np.stack(xs), *values[first : first + n]))
        first += n
    return runs


def write_slot(lora: Params, values: Params, index: jax.Array) -> Params:
    """A run's stacked "lora" arrays with slot array index `index` (slot - 1) set to `values`
    (`stack_slot_values`' tree of the run); jitted with the arrays donated (runner.py)."""

    def put(array: jax.Array, value: jax.Array, slot_axis: int) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(
            array, value.astype(array.dtype), index, slot_axis
        )

    return {
        name: {
            "a": put(w["a"], values[name]["a"], 3),  # [L, in, P, N, R]
            "b": [put(b, v, 1) for b, v in zip(w["b"], values[name]["b"], strict=True)],
        }
        for name, w in lora.items()
    }


def has_lora(params: Params) -> bool:
    """Whether the params carry slot arrays (LoRA enabled)."""
    layers = params["layers"]
    return bool(layers) and "lora" in layers[0]


class LoraRows(NamedTuple):
    """A step's token rows as the adapters see them (`lora_rows`)."""

    slots: jax.Array  # i32[T]: each row's slot (0: the base model)
    mask: jax.Array  # f32[T, N]: the same, one-hot (all zero: the base model)
    active: jax.Array  # bool[]: whether any row has an adapter


def slot_layout(params: Params) -> tuple[int, int, Any]:
    """(slots, rank, dtype) of the params' slot arrays (every A is [..., N, R])."""
    first = next(iter(params["layers"][0]["lora"].values()))["a"]
    return first.shape[-2], first.shape[-1], first.dtype


def lora_rows(lora_slots: jax.Array | None, params: Params) -> LoraRows | None:
    """Each token row's slot (i32[T], 0: none) as LoraRows; None without LoRA (no slots
    given, or params without slot arrays)."""
    if lora_slots is None or not has_lora(params):
        return None
    num_slots, _, _ = slot_layout(params)
    mask = lora_slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]
    return LoraRows(lora_slots, mask.astype(jnp.float32), jnp.any(mask))


def add_adapters(
    y: jax.Array,
    x: jax.Array | Normed,
    slots: LayerSlots,
    name: str,
    rows: LoraRows,
    real_tokens: jax.Array,
    *,
    native_base: bool,
) -> jax.Array:
    """y (x @ the base weight `name`: f32[T, out], or [T, *out] in the weight's output axes
    on the XLA form) plus every row's adapter term.

    Where the base weight runs on a native CPU kernel (`native_base`), so does the term
    (native.lora_add): each real row through its own slot only, in place, nothing for a
    base row (a Normed x normed there, for the adapter rows alone). Elsewhere, XLA's
    `lora_delta` over every slot under a lax.cond on `rows.active`: a step whose rows are all
    the base model's skips it, and the layer's slot arrays are sliced inside the branch
    (neither read nor copied)."""
    stack = slots.stack[name]
    if native_base and native.can_add_lora(stack["a"].dtype):
        runs = column_runs(name, [b.shape[3:] for b in stack["b"]])
        norm = (x.weight, x.eps) if isinstance(x, Normed) else None
        return native.lora_add(
            y,
            x.x if isinstance(x, Normed) else x,
            rows.slots,
            real_tokens,
            slots.index,
            stack["a"],
            stack["b"],
            runs,
            norm=norm,
        )
    if isinstance(x, Normed):
        x = x.value()

    def with_term(x: jax.Array, stack: Params, index: jax.Array, mask: jax.Array) -> jax.Array:
        weights = jax.tree_util.tree_map(lambda a: a[index], stack)
        return y + lora_delta(x, weights, name, mask).reshape(y.shape)

    def without(*_: Any) -> jax.Array:
        return y

    index = jnp.asarray(slots.index, jnp.int32)
    return jax.lax.cond(rows.active, with_term, without, x, stack, index, rows.mask)


def column_runs(name: str, part_shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """Where each part's output columns (part_shapes: each B's [*out_p]) lie in the weight's
    flat output: (run, stride, offset) per part, its column c at offset + (c // run) *
    stride + c % run (`lora_delta` concatenates the parts so, native.lora_add writes them
    so)."""
    axis = LORA_WEIGHTS[name][0]
    if axis is None:
        (shape,) = part_shapes
        width = math.prod(shape)
        return [(width, width, 0)]
    inner = math.prod(part_shapes[0][axis + 1 :])
    total = sum(shape[axis] for shape in part_shapes)
    runs, offset = [], 0
    for shape in part_shapes:
        runs.append((shape[axis] * inner, total * inner, offset * inner))
        offset += shape[axis]
    return runs


def lora_delta(x: jax.Array, weights: Params, name: str, mask: jax.Array) -> jax.Array:
    """f32[T, *out]: the adapters' term of `name`'s matmul for input rows x ([T, in]), each
    row through its own slot's pair (weights: one layer's slot arrays of the weight; mask:
    LoraRows.mask), in the base weight's output axes (gate/up [T, 2, I]: never merged, as
    tensor parallelism shards I)."""
    a = weights["a"]  # [in, P, N, R]
    rows, (fan_in, num_parts, num_slots, rank) = x.shape[0], a.shape
    u = dense(x, a.reshape(fan_in, -1)).reshape(rows, num_parts, num_slots, rank)
    u = u * mask[:, None, :, None]
    outs = [
        dense(u[:, p].reshape(rows, num_slots * rank), b.reshape(num_slots * rank, -1)).reshape(
            rows, *b.shape[2:]
        )
        for p, b in enumerate(weights["b"])
    ]
    axis = LORA_WEIGHTS[name][0]
    return outs[0] if axis is None else jnp.concatenate(outs, axis=1 + axis)
