"""What every model family shares with the rest of jaxcb: the spec, the params' declaration,
the attention contract, and the interface a family module implements.

A family is one module (llama.py, ...) registered in registry.py. It declares:

    ARCHITECTURES    Hugging Face `architectures` names it runs
    MODEL_TYPES      config.json `model_type` values, for configs saved without architectures
    GGUF_ARCHS       `general.architecture` values of GGUF files, mapped to an ARCHITECTURES name
    spec_from_hf_config(cfg) -> ModelSpec
    param_infos(spec) -> the params pytree of ParamInfo: each parameter's shape and the
                     logical axes runtime/sharding.py maps onto the mesh
    params_from_hf(tensors, spec, dtype) -> Params   (Hugging Face weight names → the pytree)
    forward(params, kv_caches, input_ids, positions, logits_indices, meta, *, spec,
            attention, num_compute_tokens, num_logits_rows, need_logits)
                     -> (logits, greedy ids | None, caches, hidden): hidden is the final
                     normed hidden state of every token row, which the step turns into
                     prompt logprobs through the output head (runtime/prompt_logprobs.py);
                     layer i reads and writes its pages through `layer_metadata(meta,
                     kv_caches, i, spec.num_layers)`

Conventions every family keeps, so that the CPU weight packing (cpu_params.py) and the
sharding rules work for all: the token embedding is params["embed"] [V, H] with axes ("vocab",
"embed"); the output head is params["lm_head"] [H, V] with axes ("embed", "vocab"), absent
when the embeddings are tied; a matmul weight (ParamInfo.matmul) is stored [in, ...] so that
reshaping it to [shape[0], -1] gives its [in, out] matrix.

A family whose forward needs facts beyond ModelSpec's subclasses it (a frozen dataclass with
its own fields, each with a default as ModelSpec's last field has one: e.g. the attention
soft cap or the number of experts) and returns that from
spec_from_hf_config; the rest of jaxcb reads only ModelSpec's fields.

Logical axis names (runtime/sharding.py's RULES map them to mesh axes): "vocab", "embed"
(the hidden size), "q_heads", "kv_heads", "mlp" (the MLP's intermediate axis), "qkv" (a
query group's G query heads, then K, then V), "gate_up", "head_dim".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import PADDING_SLOT, write_kv

Params = dict[str, Any]
# The page pool of every layer: (k_pages, v_pages), or quantized pages' (k_pages, v_pages,
# k_scales, v_scales); pages [Hkv, L * P, page_size, D], scales [Hkv, L * P, page_size].
# Layer l owns pages l * P ... (l + 1) * P - 1 (`layer_metadata`): one array per K and V for
# all layers, whatever the layer count, so the step takes and returns a handful of arrays.
# Unrolled layers (kernels.scan_layers false) keep the older form: a list of such tuples, one
# per layer, each over its own P pages.
KVCache = tuple[jax.Array, ...] | list[tuple[jax.Array, ...]]


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the forward pass needs; hashable so it can be static in jit."""

    family: str  # the registry's name of the family module that runs it ("llama")
    architecture: str  # the Hugging Face class name ("Qwen3ForCausalLM")
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # logits become cap * tanh(logits / cap) (Gemma 2); the greedy token is the same
    final_logit_soft_cap: float | None = None

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def active_intermediate_size(self) -> float:
        """The MLP width a token passes through, averaged over the layers: what its FLOPs
        and activations scale with (a mixture of experts counts its k experts)."""
        return float(self.intermediate_size)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter's declaration: its shape and the logical axis of each dimension.

    `matmul`: a weight the forward multiplies by (through packed.matmul), which the CPU path
    may pack for a native kernel as its [shape[0], -1] matrix. `experts`: a stack of
    per-expert matmul weights [E, in, ...] (a mixture of experts' FFN, multiplied through
    packed.grouped_matmul); expert e's [in, out] matrix is w[e].reshape(shape[1], -1).
    `dtype`: its own dtype (a quantized weight's int8 values and float32 scales,
    models/quant.py); None: the model's.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    matmul: bool = False
    dtype: str | None = None
    experts: bool = False

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.axes} differ in rank")


def is_param_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)


def abstract_from_infos(infos: Params, dtype: Any) -> Params:
    """The params pytree as ShapeDtypeStructs: what a checkpoint must hold, and the target
    of a restore."""
    return jax.tree_util.tree_map(
        lambda info: jax.ShapeDtypeStruct(info.shape, info.dtype or dtype),
        infos,
        is_leaf=is_param_info,
    )


@dataclass(frozen=True)
class AttentionMetadata:
    """What ragged paged attention needs besides q and the pages (all from StepInput)."""

    kv_lens: jax.Array  # i32[S]
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    slot_mapping: jax.Array  # i32[T]


def layer_metadata(
    meta: AttentionMetadata, kv_caches: KVCache, layer: int | jax.Array, num_layers: int
) -> AttentionMetadata:
    """`meta` for layer `layer`'s share of the pool: the page table and the slots (which
    count a layer's P pages from 0) moved up by layer x P pages; padding slots stay out of
    range. `layer` may be traced (a scan over the layers)."""
    pages_per_layer = kv_caches[0].shape[1] // num_layers
    slots_per_layer = pages_per_layer * kv_caches[0].shape[2]
    slot = meta.slot_mapping
    in_layer = (slot >= 0) & (slot < slots_per_layer)
    return dataclasses.replace(
        meta,
        page_indices=meta.page_indices + layer * pages_per_layer,
        slot_mapping=jnp.where(in_layer, slot + layer * slots_per_layer, PADDING_SLOT),
    )


AttentionFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class AttentionBackend:
    """How a layer stores new K/V into the page pool and attends over it.

    `attend` has the kernel-shaped signature of `ragged_paged_attention_reference`;
    `write_kv` that of `pallas_kernels.ragged_paged_attention.write_kv`. Both take a
    quantized pool's `k_scales` and `v_scales` (and `write_kv` then returns them too).
    `copy_kv(k_pool, v_pool, k_rows, v_rows, slot_mapping)`: rows already in the pools' dtype
    (a swapped-out quantized pool's codes, or its scales) put back bit for bit, in place;
    None: a plain XLA scatter (runtime/kv_swap.py's `put_rows`).
    """

    name: str
    attend: AttentionFn
    write_kv: Callable[..., tuple[jax.Array, ...]] = write_kv
    copy_kv: Callable[..., tuple[jax.Array, jax.Array]] | None = None
