"""Mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE, over a paged KV cache.

Attention, norms and the dense MLP are the Llama family's (llama.py's config mapping and
parameters, sublayers.py's attention and MLP): Mixtral's attention is Mistral's, Qwen2-MoE's
Qwen2's (q/k/v biases), Qwen3-MoE's Qwen3's (q/k norms). What differs is the feed-forward
block of the sparse layers: a router picks each token's top-k experts, each a SwiGLU MLP of
moe_intermediate_size, and their outputs are summed weighted by the router's probabilities
(renormalised over the k for Mixtral and where norm_topk_prob says); Qwen2-MoE adds a shared
expert gated by sigmoid(shared_expert_gate(x)). Layers listed in mlp_only_layers, or off the
decoder_sparse_step, keep a dense MLP of intermediate_size.

The router's choice is transformers' (`route`); experts.py runs each token through its
experts on the device, in static shapes: each expert's rows in one grouped matmul.

Tensor parallelism splits every expert along its own intermediate axis, like the dense MLP
(gate/up by column, down by row; `"experts"` is replicated in sharding.RULES): each device
holds a 1/N slice of all E experts, runs the same routing on its replicated residual, and
one all-reduce after the down projection finishes the layer, as for a dense layer. Expert
parallelism (whole experts per device) would instead need two all-to-all exchanges of token
rows per layer, and its load follows the routing: a batch whose tokens favour one expert
waits on that expert's device. Slicing every expert costs nothing in balance whatever the
router does, needs no token exchange, and keeps one code path for every TP size; its limit
is moe_intermediate_size / N (each device's slice must stay wide enough for an efficient
matmul), which is ample for the models here at the TP sizes one host offers.

Parameters of a sparse layer (besides llama.py's attention ones): `router [H, E]` (plain, so
the logits stay float32-exact), `w_experts_gate_up [E, H, 2, I]`, `w_experts_down [E, I, H]`
(ParamInfo.experts), and for a shared expert `w_shared_gate_up [H, 2, Is]`,
`w_shared_down [Is, H]` (ordinary matmul weights, run by sublayers.mlp) and `shared_gate [H]`.

GGUF files (llama.cpp's "qwen2moe", "qwen3moe", and Mixtral's "llama"): the GGUF section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.lora import lora_rows
from jaxcb.models import llama
from jaxcb.models.base import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    ModelSpec,
    ParamInfo,
    Params,
)
from jaxcb.models.experts import experts_ffn
from jaxcb.models.layers import dense, rms_norm, rope_for
from jaxcb.models.packed import embed_tokens, lm_head
from jaxcb.models.stacking import run_layers
from jaxcb.models.sublayers import attention_block, mlp, project
from jaxcb.models.weights import CheckpointTensors, ConfigFields, ModelLoadError, cast

#: Hugging Face class -> variant (its config.json model_type)
VARIANTS = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
ARCHITECTURES = tuple(VARIANTS)
MODEL_TYPES = {variant: arch for arch, variant in VARIANTS.items()}
#: the Llama-family architecture whose attention (and config mapping) each variant shares
ATTENTION_OF = {
    "mixtral": "MistralForCausalLM",
    "qwen2_moe": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3ForCausalLM",
}
#: checkpoint names of a sparse layer's block, its router and its experts' gate, up, down
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
}


@dataclass(frozen=True)
class MoESpec(ModelSpec):
    """ModelSpec plus the mixture's facts. intermediate_size is the dense layers' MLP (for
    Mixtral, whose layers are all sparse, the experts' size as in its config)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: experts per token
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[bool, ...] = ()  # per layer: a mixture of experts, else a dense MLP

    @property
    def active_intermediate_size(self) -> float:
        sparse = self.num_experts_per_tok * self.moe_intermediate_size
        sparse += self.shared_expert_intermediate_size
        widths = [sparse if s else self.intermediate_size for s in self.sparse_layers]
        return sum(widths) / len(widths)

    @property
    def routing_weights_in_model_dtype(self) -> bool:
        """Qwen's routers round the k weights to the model's dtype; Mixtral's keep float32."""
        return self.architecture != "MixtralForCausalLM"


# ---- config -----------------------------------------------------------------------------


def spec_from_hf_config(cfg: dict[str, Any], architecture: str) -> MoESpec:
    """Map a Hugging Face config.json of `architecture` onto the facts the forward needs:
    the attention's through llama.py's mapping, then the mixture's."""
    variant = VARIANTS[architecture]
    f = ConfigFields(cfg)
    num_layers = f.integer("num_hidden_layers")
    window = f.integer("sliding_window", 0)
    sliding = f.get("use_sliding_window", False) and window
    if variant == "qwen2_moe" and sliding and not f.get("layer_types"):
        # transformers' default for this model: every other layer below max_window_layers
        first_full = f.integer("max_window_layers", num_layers)
        types = ["sliding" if i % 2 == 0 and i < first_full else "full" for i in range(num_layers)]
        cfg = {**cfg, "layer_types": [t + "_attention" for t in types]}
    if variant == "qwen3_moe" and f.flag("attention_bias", False):
        raise ModelLoadError("Qwen3-MoE with attention_bias (an o_proj bias) is not supported")
    base = llama.spec_from_hf_config(cfg, ATTENTION_OF[variant])
    fields = {field.name: getattr(base, field.name) for field in dataclasses.fields(base)}
    fields.update(family="moe", architecture=architecture)
    if variant == "qwen2_moe":
        fields["qkv_bias"] = f.flag("qkv_bias", True)
    if variant == "qwen3_moe":  # one window for every layer, when enabled
        fields["sliding_windows"] = (window if sliding else None,) * num_layers

    num_experts = f.integer("num_local_experts", None)  # Mixtral's; Qwen3-MoE's saved name
    if num_experts is None:
        num_experts = f.integer("num_experts")
    top_k = f.integer("num_experts_per_tok")
    if variant == "mixtral":
        moe_size, norm_topk, shared, sparse = base.intermediate_size, True, 0, [True] * num_layers
    else:
        moe_size = f.integer("moe_intermediate_size")
        norm_topk = f.flag("norm_topk_prob", False)
        shared = f.integer("shared_expert_intermediate_size") if variant == "qwen2_moe" else 0
        step = f.integer("decoder_sparse_step", 1)
        dense_layers = f.get("mlp_only_layers", [])
        if step < 1 or not isinstance(dense_layers, list):
            raise ModelLoadError(
                f"config.json: decoder_sparse_step must be >= 1 and mlp_only_layers a list, "
                f"got {step!r} and {dense_layers!r}"
            )
        sparse = [
            i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
            for i in range(num_layers)
        ]
    if any(sparse) and not (1 <= top_k <= num_experts and moe_size >= 1):
        raise ModelLoadError(
            f"config.json: num_experts_per_tok={top_k} must be between 1 and the number of "
            f"experts ({num_experts}), and the experts' intermediate size ({moe_size}) >= 1"
        )
    return MoESpec(
        **fields,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_size,
        norm_topk_prob=norm_topk,
        shared_expert_intermediate_size=shared,
        sparse_layers=tuple(sparse),
    )


# ---- parameters -------------------------------------------------------------------------


def param_infos(spec: MoESpec) -> Params:
    """llama.py's parameters, with each sparse layer's dense MLP replaced by its router and
    experts (and shared expert)."""
    params = llama.param_infos(spec)
    for layer, sparse in zip(params["layers"], spec.sparse_layers, strict=True):
        if sparse:
            del layer["w_gate_up"], layer["w_down"]
            layer.update(_sparse_infos(spec))
    return params


def _sparse_infos(spec: MoESpec) -> Params:
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    infos = {
        "router": ParamInfo((h, e), ("embed", "experts")),
        "w_experts_gate_up": ParamInfo(
            (e, h, 2, i), ("experts", "embed", "gate_up", "mlp"), experts=True
        ),
        "w_experts_down": ParamInfo((e, i, h), ("experts", "mlp", "embed"), experts=True),
    }
    if s := spec.shared_expert_intermediate_size:
        infos["w_shared_gate_up"] = ParamInfo((h, 2, s), ("embed", "gate_up", "mlp"), True)
        infos["w_shared_down"] = ParamInfo((s, h), ("mlp", "embed"), True)
        infos["shared_gate"] = ParamInfo((h,), ("embed",))
    return infos


def params_from_hf(tensors: CheckpointTensors, spec: MoESpec, dtype: Any) -> Params:
    """The params pytree (host arrays of `dtype`) from a Hugging Face checkpoint: llama.py's
    for attention, norms, embeddings and dense layers; the experts stacked per layer."""
    h, i = spec.hidden_size, spec.intermediate_size

    def ffn(n: int) -> Params:
        if spec.sparse_layers[n]:
            return _sparse_from_hf(tensors, spec, n, dtype)
        return llama.dense_mlp_from_hf(tensors, f"model.layers.{n}.mlp.", (h, i), dtype)

    return llama.params_from_hf(tensors, spec, dtype, mlp_from_hf=ffn)


def _sparse_from_hf(tensors: CheckpointTensors, spec: MoESpec, n: int, dtype: Any) -> Params:
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    block, gate_name, up_name, down_name = EXPERT_NAMES[VARIANTS[spec.architecture]]
    p = f"model.layers.{n}.{block}"
    take = tensors.take
    gate_up = np.empty((e, h, 2, i), dtype)
    down = np.empty((e, i, h), dtype)
    if tensors.shape(f"{p}experts.{gate_name}.weight") is not None:
        # GGUF: llama.cpp's stacks [E, out, in] (GGUF_TENSORS), one float32 stack at a time
        for j, name in enumerate((gate_name, up_name)):
            stack = take(f"{p}experts.{name}.weight", (e, i, h))
            gate_up[:, :, j] = cast(stack, dtype).transpose(0, 2, 1)
        down[:] = cast(take(f"{p}experts.{down_name}.weight", (e, h, i)), dtype).transpose(0, 2, 1)
    else:  # filled expert by expert in `dtype`: never a float32 copy of a layer's experts
        for x in range(e):
            q = f"{p}experts.{x}."
            gate_up[x, :, 0] = cast(take(q + gate_name + ".weight", (i, h)).T, dtype)
            gate_up[x, :, 1] = cast(take(q + up_name + ".weight", (i, h)).T, dtype)
            down[x] = cast(take(q + down_name + ".weight", (h, i)).T, dtype)
    out = {
        "router": cast(take(p + "gate.weight", (e, h)).T, dtype),
        "w_experts_gate_up": gate_up,
        "w_experts_down": down,
    }
    if s := spec.shared_expert_intermediate_size:
        shared = llama.dense_mlp_from_hf(tensors, p + "shared_expert.", (h, s), dtype)
        out["w_shared_gate_up"], out["w_shared_down"] = shared["w_gate_up"], shared["w_down"]
        gate = p + "shared_expert_gate.weight"  # [1, H]; [H] in older GGUF files (squeezed)
        shape = (h,) if tensors.shape(gate) == (h,) else (1, h)
        out["shared_gate"] = cast(take(gate, shape).reshape(h), dtype)
    return out


# ---- GGUF -------------------------------------------------------------------------------
# llama.cpp's "qwen2moe" and "qwen3moe" archs, and Mixtral, which it writes as "llama" with a
# router in each layer, `blk.N.ffn_gate_inp.weight` [E, H] (GGUF_ARCHS_BY_TENSOR, registry.py).
# Its converter stacks a layer's experts: `ffn_{gate,up,down}_exps` [E, out, in] in numpy
# order (blocks run along `in`: dequantized, the per-expert matrices stacked). GGUF_TENSORS
# names a stack `<block>experts.<projection>.weight` (gguf's own "merged" name) and
# _sparse_from_hf takes it whole. Older converters' per-expert 2-D tensors are refused.
# Attention is Llama's: Mixtral's q/k rows are permuted (llama.tensor_from_gguf undoes it for
# "llama"), Qwen's are not. For int8, a block-quantized file's attention and shared-expert
# matrices are held to their blocks (loader.load_gguf_block_grids); the expert stacks are no
# matmul weights (ParamInfo.experts) and load dequantized, as from any checkpoint.

GGUF_ARCHS = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
GGUF_ARCHS_BY_TENSOR = {("llama", "blk.0.ffn_gate_inp.weight"): "MixtralForCausalLM"}
tensor_from_gguf = llama.tensor_from_gguf


def _gguf_expert_names() -> dict[str, tuple[str, ...]]:
    """GGUF router and expert stacks -> their names in each variant (EXPERT_NAMES)."""
    out: dict[str, tuple[str, ...]] = {}
    for block, gate, up, down in dict.fromkeys(EXPERT_NAMES.values()):
        for gguf_name, part in [
            ("ffn_gate_inp", "gate"),
            ("ffn_gate_exps", f"experts.{gate}"),
            ("ffn_up_exps", f"experts.{up}"),
            ("ffn_down_exps", f"experts.{down}"),
        ]:
            key = f"blk.{{n}}.{gguf_name}.weight"
            out[key] = (*out.get(key, ()), f"model.layers.{{n}}.{block}{part}.weight")
    return out


#: GGUF tensor name -> Hugging Face name(s): Llama's, the experts, Qwen2-MoE's shared expert
GGUF_TENSORS = {
    **llama.GGUF_TENSORS,
    **_gguf_expert_names(),
    "blk.{n}.ffn_gate_inp_shexp.weight": "model.layers.{n}.mlp.shared_expert_gate.weight",
} | {
    f"blk.{{n}}.ffn_{x}_shexp.weight": f"model.layers.{{n}}.mlp.shared_expert.{x}_proj.weight"
    for x in ("gate", "up", "down")
}


def config_from_gguf(metadata: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Llama's mapping, plus `<arch>.expert_count`, `expert_used_count` and (Qwen; Mixtral's
    experts are `feed_forward_length` wide) `expert_feed_forward_length` and Qwen2-MoE's
    `expert_shared_feed_forward_length`. The layers without a router are Qwen's
    mlp_only_layers. norm_topk_prob: `expert_weights_norm` if the file has it, else what
    llama.cpp assumes: Qwen2-MoE's are not renormalised, Qwen3-MoE's are (all released ones)."""
    arch = metadata.require("general.architecture")
    architecture = GGUF_ARCHS.get(arch, "MixtralForCausalLM")
    if "blk.0.ffn_gate.0.weight" in shapes:
        raise ModelLoadError(
            f"{metadata.path} stores each expert as its own tensor (blk.N.ffn_gate.E.weight, "
            "an older llama.cpp converter); jaxcb reads the stacked ffn_*_exps tensors: "
            "convert the model again with a recent convert_hf_to_gguf.py"
        )
    cfg = llama.config_from_gguf(metadata, shapes, architecture)
    cfg["model_type"] = VARIANTS[architecture]
    cfg["num_local_experts"] = metadata.require(f"{arch}.expert_count")
    cfg["num_experts_per_tok"] = metadata.require(f"{arch}.expert_used_count")
    if arch == "llama":  # Mixtral: every layer sparse
        return cfg
    cfg["moe_intermediate_size"] = metadata.require(f"{arch}.expert_feed_forward_length")
    cfg["mlp_only_layers"] = [
        n for n in range(cfg["num_hidden_layers"]) if f"blk.{n}.ffn_gate_inp.weight" not in shapes
    ]
    cfg["norm_topk_prob"] = bool(metadata.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    if arch == "qwen2moe":
        key = f"{arch}.expert_shared_feed_forward_length"
        cfg["shared_expert_intermediate_size"] = metadata.require(key)
        cfg["qkv_bias"] = cfg["attention_bias"]
    return cfg


# ---- forward ----------------------------------------------------------------------------


def forward(
    params: Params,
    kv_caches: KVCache,
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    logits_indices: jax.Array,  # i32[S]: rows whose next token is sampled
    meta: AttentionMetadata,
    *,
    spec: MoESpec,
    attention: AttentionBackend,
    num_compute_tokens: jax.Array,  # i32[1]
    num_logits_rows: jax.Array,  # i32[1]: the real rows of logits_indices
    need_logits: jax.Array,  # bool[]: whether anything but the greedy tokens is read
    scan_layers: bool = True,
    lora_slots: jax.Array | None = None,  # i32[T]: each token row's LoRA slot (0: none)
) -> tuple[jax.Array, jax.Array | None, KVCache, jax.Array]:
    """One forward pass over a packed ragged batch; the contract of llama.forward."""
    real_tokens = num_compute_tokens[0]
    rope = rope_for(spec, positions)
    x = embed_tokens(params, input_ids)  # [T, H], float32 throughout

    def layer_fn(layer: Params, carry: tuple, i: Any, kind: int, lora: Any = None) -> tuple:
        x, kv_caches = carry
        h = rms_norm(x, layer["attn_norm"], spec.rms_norm_eps)
        attn, kv_caches = attention_block(
            layer,
            h,
            rope,
            kv_caches,
            meta,
            spec,
            attention,
            i,
            real_tokens,
            sliding_window=spec.sliding_windows[kind],
            lora=lora,
        )
        x = x + project(attn, layer, "wo", real_tokens, lora)
        h = rms_norm(x, layer["mlp_norm"], spec.rms_norm_eps)
        if spec.sparse_layers[kind]:
            return x + sparse_mlp(layer, h, spec, real_tokens), kv_caches
        return x + mlp(layer, h, real_tokens, lora=lora), kv_caches

    # (dense and sparse layers hold different weights: separate stacked runs)
    kinds = tuple(zip(spec.sliding_windows, spec.sparse_layers, strict=True))
    x, kv_caches = run_layers(
        params["layers"],
        (x, kv_caches),
        layer_fn,
        kinds=kinds,
        scan=scan_layers,
        lora=lora_rows(lora_slots, params),
    )
    hidden = rms_norm(x, params["final_norm"], spec.rms_norm_eps)  # [T, H]
    logits, greedy = lm_head(params, hidden[logits_indices], num_logits_rows[0], need_logits)
    return logits, greedy, kv_caches, hidden


def sparse_mlp(layer: Params, h: jax.Array, spec: MoESpec, real_tokens: jax.Array) -> jax.Array:
    """A sparse layer's feed-forward output [T, H] for the normed residual h [T, H]: the
    routed experts, plus the gated shared expert where the model has one."""
    weights, experts = route(h, layer["router"], spec)
    out = experts_ffn(
        h,
        weights,
        experts,
        layer["w_experts_gate_up"],
        layer["w_experts_down"],
        spec.num_experts,
        real_tokens,
    )
    if spec.shared_expert_intermediate_size:
        shared = {"w_gate_up": layer["w_shared_gate_up"], "w_down": layer["w_shared_down"]}
        gate = jax.nn.sigmoid(dense(h, layer["shared_gate"][:, None]))  # [T, 1]
        out = out + gate * mlp(shared, h, real_tokens)
    return out


def route(h: jax.Array, router: jax.Array, spec: MoESpec) -> tuple[jax.Array, jax.Array]:
    """Each token's k experts (i32[T, k], most probable first) and their weights (f32[T, k]),
    as transformers computes them: logits in the model's dtype, softmax in float32 over all
    experts, top-k (ties to the lower index), then the optional renormalisation over the k."""
    logits = dense(h, router).astype(router.dtype).astype(jnp.float32)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, spec.num_experts_per_tok)
    if spec.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if spec.routing_weights_in_model_dtype:
        weights = weights.astype(router.dtype).astype(jnp.float32)
    return weights, experts
