"""Device meshes and the logical-axis sharding rules: the one place tensor parallelism is decided.

Every array the step function touches names its axes logically ("vocab", "embed",
"q_heads", "kv_heads", "mlp", ...): a model family declares its parameters' axes next to
their shapes (its `param_infos`); the KV pages, queries and logits are named here. `RULES`
maps each logical name to a mesh axis (or to None: replicated), and everything else here
turns those names into PartitionSpecs and NamedShardings. With `tensor_parallel_size = N`
the layout is Megatron's:

- q/k/v by KV head (`wqkv [H, Hkv, G + 2, D]` keeps each KV head with its G query heads, so
  a device holds whole GQA groups), the o-projection by query head: one all-reduce;
- the MLP by its intermediate axis (gate/up by column, down by row): one all-reduce; a
  mixture of experts' FFN alike, each expert split by its own intermediate axis and every
  device holding a slice of every expert (models/moe.py says why);
- the embedding table and lm_head by vocabulary entry;
- the KV page pool by KV head: each device holds a dense `[Hkv / N, P, page_size, D]`
  slice of every page, and the attention kernels and the KV write run per shard under
  `jax.shard_map` (they are custom kernels XLA cannot partition on its own).

The rest of the step (norms, rope, sampling) is left to XLA's partitioner, which follows
the parameters' shardings. Data parallelism is not in the step at all: each replica is an
independent engine on its own row of the (data, tensor) mesh (jaxcb/build.py builds them,
engine/replicated.py routes requests between them).

Multi-host: `setup_distributed` (runtime/distributed.py) wires `jax.distributed.initialize`,
after which `jax.devices()` lists every process's devices and the same mesh spans hosts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxcb.config import ParallelConfig
from jaxcb.models import registry
from jaxcb.models.base import AttentionBackend, ModelSpec, is_param_info
from jaxcb.runtime.distributed import (  # noqa: F401 (initialize_distributed: its old home)
    initialize_distributed,
    setup_distributed,
)

logger = logging.getLogger(__name__)

DATA_AXIS = "data"  # mesh axis of data-parallel replicas
TENSOR_AXIS = "tensor"  # mesh axis tensor parallelism shards over

#: logical axis name -> mesh axis (None: replicated on every device of the replica).
RULES: dict[str, str | None] = {
    "layers": None,  # a stack of layers' weights (models/stacking.py): whole on every device
    "vocab": TENSOR_AXIS,  # embedding rows, lm_head columns
    "embed": None,  # the hidden size: the residual stream is whole on every device
    "q_heads": TENSOR_AXIS,  # query heads (o-projection rows are heads x head_dim)
    "kv_heads": TENSOR_AXIS,  # KV heads: the q/k/v groups and the KV page pool
    "mlp": TENSOR_AXIS,  # the MLP's intermediate axis (each expert's too)
    "experts": None,  # a mixture of experts: every device holds a slice of every expert
    "qkv": None,  # a group's G query heads, then K, then V
    "gate_up": None,
    "head_dim": None,
    "pages": None,
    "page_slots": None,
    "tokens": None,
    "seqs": None,
    # LoRA slot arrays (jaxcb/lora.py): their parts, slots and rank whole on every device
    "lora_parts": None,
    "lora_slots": None,
    "lora_rank": None,
}

KV_PAGES_AXES = ("kv_heads", "pages", "page_slots", "head_dim")  # [Hkv, P, page_size, D]
KV_SCALES_AXES = ("kv_heads", "pages", "page_slots")  # quantized pages' scales: [Hkv, P, ps]
Q_AXES = ("tokens", "q_heads", "head_dim")  # attention's q and output: [T, Hq, D]
KV_NEW_AXES = ("tokens", "kv_heads", "head_dim")  # a step's new K or V: [T, Hkv, D]
LOGITS_AXES = ("seqs", "vocab")  # [S, V]


# ---- rules ------------------------------------------------------------------------------


def check_tensor_parallel(spec: ModelSpec, tensor_parallel_size: int) -> None:
    """ValueError unless the model's heads and MLP split evenly over `tensor_parallel_size`.

    KV heads are never replicated to make a split fit: a pool holding copies of the same
    head would cost memory silently; pick a size that divides num_key_value_heads.
    """
    tp = tensor_parallel_size
    if tp == 1:
        return
    if spec.num_kv_heads % tp:
        divisors = [n for n in range(1, spec.num_kv_heads + 1) if spec.num_kv_heads % n == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's num_key_value_heads="
            f"{spec.num_kv_heads} (q/k/v and the KV pages are sharded by KV head); "
            f"valid sizes: {divisors}"
        )
    # a mixture of experts' spec (models/moe.py) adds its experts' and shared expert's sizes
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(spec, field, 0) % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {field}="
                f"{getattr(spec, field)} (the MLP is sharded along it)"
            )


def rules_for(spec: ModelSpec, tensor_parallel_size: int) -> dict[str, str | None]:
    """RULES for this model, after checking it divides; a vocabulary that does not divide
    is kept whole (replicated), which costs memory but is still correct."""
    check_tensor_parallel(spec, tensor_parallel_size)
    rules = dict(RULES)
    if spec.vocab_size % tensor_parallel_size:
        logger.warning(
            "vocab_size=%d is not divisible by tensor_parallel_size=%d: the embedding and "
            "lm_head are replicated on every device instead of sharded",
            spec.vocab_size,
            tensor_parallel_size,
        )
        rules["vocab"] = None
    return rules


def logical_spec(axes: Sequence[str], rules: dict[str, str | None] | None = None) -> PartitionSpec:
    """PartitionSpec of an array whose dimensions carry these logical names."""
    rules = RULES if rules is None else rules
    unknown = [a for a in axes if a not in rules]
    if unknown:
        raise ValueError(f"no sharding rule for logical axes {unknown}; known: {sorted(rules)}")
    return PartitionSpec(*(rules[a] for a in axes))


def param_shardings(infos: Any, mesh: Mesh, rules: dict[str, str | None] | None = None) -> Any:
    """A NamedSharding per parameter, from the family's declarations (a pytree of ParamInfo:
    each parameter's logical axes)."""
    return jax.tree_util.tree_map(
        lambda info: NamedSharding(mesh, logical_spec(info.axes, rules)),
        infos,
        is_leaf=is_param_info,
    )


def bytes_per_device(params: Any, shardings: Any, *, skip: Any = None) -> int:
    """Bytes one device holds of `params` (arrays or their shapes) once placed as
    `shardings` (the same tree of NamedShardings) say: a sharded array's shard, a replicated
    one whole. `skip(leaf)`: leaves not to count."""
    counts = jax.tree_util.tree_map(
        lambda x, s: (
            0
            if skip is not None and skip(x)
            else math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        ),
        params,
        shardings,
    )
    return sum(jax.tree_util.tree_leaves(counts))


def model_param_shardings(spec: ModelSpec, *, mesh: Mesh) -> Any:
    """The target shardings of `spec`'s params on `mesh` (ValueError if it does not divide)."""
    rules = rules_for(spec, tensor_parallel_size(mesh))
    return param_shardings(registry.param_infos(spec), mesh, rules)


def kv_pages_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(KV_PAGES_AXES))


def kv_scales_sharding(mesh: Mesh) -> NamedSharding:
    """A quantized pool's scales go with their pages: split by KV head."""
    return NamedSharding(mesh, logical_spec(KV_SCALES_AXES))


def kv_cache_shardings(mesh: Mesh, kv_caches: Any) -> Any:
    """The shardings of a pool's per-layer arrays (a pytree like `kv_caches`): the pages by
    KV head, and a quantized pool's scales ([Hkv, P, page_size], one dimension less) so too."""
    pages, scales = kv_pages_sharding(mesh), kv_scales_sharding(mesh)
    return jax.tree_util.tree_map(lambda x: pages if x.ndim == 4 else scales, kv_caches)


def logits_shardings(mesh: Mesh, rules: dict[str, str | None]) -> tuple[NamedSharding, ...]:
    """For step(): the shardings the logits take in turn before sampling.

    With tensor parallelism the lm_head makes them split by vocabulary. On CPU devices they
    are then gathered whole onto every device (one all-gather of [S, V], rather than a
    collective inside each of sampling's reductions, cheap between threads of one host). On
    TPUs and GPUs they stay split: every [S, V] pass of sampling (penalties, softmax, the
    filters' threshold searches, a cond's copy) then reads 1/TP of the row per chip, and
    its reductions end in an all-reduce of [S] values (the 8B decode step at 256 sequences
    on v5e x4: 155 MB per pass per chip gathered, 39 MB split)."""
    if tensor_parallel_size(mesh) == 1:
        return ()
    split = NamedSharding(mesh, logical_spec(LOGITS_AXES, rules))
    if mesh.devices.flat[0].platform == "cpu":
        return (split, replicated(mesh))
    return (split,)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_params(params: Any, shardings: Any) -> Any:
    """Place a params pytree with its shardings. Host (numpy) leaves are cut on the host, so
    each device receives only its shard; leaves already on devices are moved if needed."""

    def put(leaf: Any, sharding: NamedSharding) -> jax.Array:
        if isinstance(leaf, jax.Array):
            return jax.device_put(leaf, sharding)
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(put, params, shardings)


# ---- meshes -----------------------------------------------------------------------------


def device_mesh(
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """The (data, tensor) mesh over the first dp x tp devices (all processes' devices once
    jax.distributed is initialized). `jax.make_mesh` orders them along the hardware's
    topology on TPU, so each tensor-parallel group sits on neighbouring chips."""
    dp, tp = data_parallel_size, tensor_parallel_size
    devices = list(jax.devices() if devices is None else devices)
    need = dp * tp
    if need > len(devices):
        platform = devices[0].platform if devices else jax.default_backend()
        raise ValueError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {need} devices, but "
            f"{len(devices)} {platform} device(s) are available"
        )
    devices = devices[:need]
    axis_types = (AxisType.Auto, AxisType.Auto)
    try:
        return jax.make_mesh(
            (dp, tp), (DATA_AXIS, TENSOR_AXIS), axis_types=axis_types, devices=devices
        )
    except (ValueError, NotImplementedError, AssertionError):
        # A subset of a TPU slice may not map onto its physical topology: keep the order.
        grid = np.asarray(devices, dtype=object).reshape(dp, tp)
        return Mesh(grid, (DATA_AXIS, TENSOR_AXIS), axis_types=axis_types)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One 1-D (tensor) mesh per data-parallel replica: the rows of a (data, tensor) mesh."""
    return [
        Mesh(row, (TENSOR_AXIS,), axis_types=(AxisType.Auto,))
        for row in np.asarray(mesh.devices).reshape(mesh.shape[DATA_AXIS], -1)
    ]


def replica_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The tensor mesh of one engine: `devices` (exactly tensor_parallel_size of them), or
    the first tensor_parallel_size devices."""
    if devices is not None and len(devices) != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices per "
            f"replica, got {len(devices)}"
        )
    return replica_meshes(device_mesh(1, tensor_parallel_size, devices))[0]


def engine_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of one engine (one data-parallel replica): `devices`, or the first
    tensor_parallel_size devices. Initializes jax.distributed first if the config says so."""
    setup_distributed(parallel)
    if parallel.data_parallel_size > 1 and devices is None:
        raise ValueError(
            f"data_parallel_size={parallel.data_parallel_size}: build the engine with "
            "jaxcb.build.build_engine (LLM and the server do), which gives each "
            "replica its devices"
        )
    mesh = replica_mesh(parallel.tensor_parallel_size, devices)
    processes = {d.process_index for d in mesh.devices.flat}
    if jax.process_count() > 1 and len(processes) < jax.process_count():
        raise ValueError(
            f"tensor_parallel_size={parallel.tensor_parallel_size} uses the devices of "
            f"{len(processes)} of {jax.process_count()} processes; in a multi-host job every "
            f"process drives its devices, so use all {jax.device_count()} of them"
        )
    return mesh


def tensor_parallel_size(mesh: Mesh) -> int:
    return int(mesh.shape[TENSOR_AXIS])


# ---- attention per shard ----------------------------------------------------------------


def shard_attention(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """Run `backend`'s attention and KV write per KV-head shard under `jax.shard_map`.

    Each device attends with its own query heads over its own slice of the page pool; page
    tables and lengths are replicated. No communication happens inside: the o-projection's
    all-reduce after it is XLA's. The kernels see ordinary (local) shapes, so every backend
    (native FFI, XLA, Pallas) runs unchanged.
    """
    if tensor_parallel_size(mesh) == 1:
        return backend
    q_spec, new_spec = logical_spec(Q_AXES), logical_spec(KV_NEW_AXES)
    pages_spec, rep = logical_spec(KV_PAGES_AXES), PartitionSpec()
    scales_spec = logical_spec(KV_SCALES_AXES)

    def attend(*args, k_scales=None, v_scales=None, **kwargs):
        """(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs), as the kernels."""
        args = list(args)
        specs = [q_spec, pages_spec, pages_spec, rep, rep, rep, rep]
        if k_scales is not None:  # quantized pages: their scales are split alike
            args += [k_scales, v_scales]
            specs += [scales_spec, scales_spec]

        def kernel(*local):
            scales = dict(zip(("k_scales", "v_scales"), local[7:], strict=False))
            return backend.attend(*local[:7], **kwargs, **scales)

        sharded = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=q_spec,
            check_vma=False,  # custom kernels (FFI, Pallas) carry no replication rules
        )
        return sharded(*args)

    def write_kv(k_pages, v_pages, k, v, slot_mapping, k_scales=None, v_scales=None):
        args = [k_pages, v_pages, k, v, slot_mapping]
        specs = [pages_spec, pages_spec, new_spec, new_spec, rep]
        outs = (pages_spec, pages_spec)
        if k_scales is not None:
            args += [k_scales, v_scales]
            specs += [scales_spec, scales_spec]
            outs += (scales_spec, scales_spec)
        sharded = jax.shard_map(
            backend.write_kv,
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=outs,
            check_vma=False,
        )
        return sharded(*args)

    return AttentionBackend(f"{backend.name}", attend, write_kv)
