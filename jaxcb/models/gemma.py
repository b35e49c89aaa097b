"""The Gemma family: Gemma 2 and Gemma 3 (text), on the attention and MLP sub-layers of the
Llama family (sublayers.py).

What differs from Llama, and where it lives here:

- RMSNorm scales by (1 + w), in float32 (Hugging Face's Gemma norms). The stored norm weights
  are 1 + w, computed once at load in float32 from the weights in the model's dtype, and
  declared float32 (ParamInfo.dtype): the forward then runs Llama's plain `rms_norm`, and a
  bfloat16 model's norms round as transformers' do (it adds 1 to the bf16 weight in f32).
- Four norms a layer: before and after attention, before and after the MLP (the "post" ones
  normalise a block's output before it joins the residual).
- The token embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype.
- GeGLU: gelu (tanh approximation) of the gate, not silu.
- Queries scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap)); sliding-window
  and global layers alternate (`layer_types`, else every other layer from the first).
- Gemma 3: q/k RMSNorm per head (the (1 + w) kind), no soft caps, five sliding layers to a
  global one, and two rotary tables: sliding layers use `rope_local_base_freq` (10000)
  without scaling, global ones `rope_theta` (1e6) with the config's scaling.

GGUF files (llama.cpp's "gemma2" and "gemma3" archs): the GGUF section at the end.

Parameters: Llama's (wqkv grouped per KV head, w_gate_up [H, 2, I], ...) plus "post_attn_norm"
and "post_mlp_norm"; "mlp_norm" is the pre-feedforward norm. Embeddings are tied (as in every
released Gemma) unless the config says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.lora import lora_rows
from jaxcb.models import llama
from jaxcb.models.base import AttentionBackend, AttentionMetadata, KVCache, ModelSpec, Params
from jaxcb.models.layers import rms_norm, rope_for, soft_cap
from jaxcb.models.packed import embed_tokens, lm_head
from jaxcb.models.stacking import run_layers
from jaxcb.models.sublayers import attention_block, mlp, project
from jaxcb.models.weights import CheckpointTensors, ConfigFields, ModelLoadError, cast

#: Hugging Face class -> variant
VARIANTS = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
ARCHITECTURES = tuple(VARIANTS)
MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
ACTIVATIONS = {
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}
#: Norms stored as 1 + w, in float32
NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm")


@dataclasses.dataclass(frozen=True)
class GemmaSpec(ModelSpec):
    query_pre_attn_scalar: float = 256.0
    attn_logit_soft_cap: float | None = None
    activation: str = "gelu_pytorch_tanh"
    # sliding layers' rotary base and scaling (Gemma 3); None: the global ones
    local_rope_theta: float | None = None
    local_rope_scaling: tuple[tuple[str, Any], ...] | None = None

    @property
    def sm_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5


# ---- config -----------------------------------------------------------------------------


def spec_from_hf_config(cfg: dict[str, Any], architecture: str) -> GemmaSpec:
    """Map a Gemma 2 / Gemma 3 text config.json (transformers 4 or 5 layout) onto the spec."""
    variant = VARIANTS[architecture]
    f = ConfigFields(cfg)
    activation = f.get("hidden_activation") or f.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported hidden_activation {activation!r}; {list(ACTIVATIONS)}")
    rope = dict(f.get("rope_parameters") or {})
    # transformers 5 nests Gemma 3's two rotary setups under the layer types
    global_rope, local_rope = rope.get("full_attention"), rope.get("sliding_attention")
    plain = dict(cfg, rope_parameters=global_rope) if global_rope is not None else cfg
    # Llama's reading of the shared fields; the activation and windows are read here
    shared = {k: v for k, v in plain.items() if k not in ("hidden_act", "sliding_window")}
    base = llama.spec_from_hf_config(shared, "LlamaForCausalLM")
    num_layers = base.num_layers
    pattern = 2 if variant == "gemma2" else f.integer("sliding_window_pattern", 6)
    layer_types = f.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    window = f.integer("sliding_window", 4096)
    local_theta, local_scaling = None, None
    if variant == "gemma3":
        if local_rope is not None:
            local = {"rope_parameters": local_rope}
            local_theta, local_scaling = llama.rope_from_config(local, ConfigFields(local))
        else:
            local_theta = f.number("rope_local_base_freq", 10000.0)
    return GemmaSpec(
        **{
            **{k.name: getattr(base, k.name) for k in dataclasses.fields(ModelSpec)},
            "family": "gemma",
            "architecture": architecture,
            "qk_norm": variant == "gemma3",
            "sliding_windows": tuple(
                window if t == "sliding_attention" else None for t in layer_types
            ),
            "tie_word_embeddings": f.flag("tie_word_embeddings", True),
            "final_logit_soft_cap": f.number("final_logit_softcapping", None),
        },
        query_pre_attn_scalar=f.number("query_pre_attn_scalar", base.head_dim),
        attn_logit_soft_cap=f.number("attn_logit_softcapping", None),
        activation=activation,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


# ---- parameters -------------------------------------------------------------------------


def param_infos(spec: GemmaSpec) -> Params:
    """Llama's parameters, the two post norms added, every norm float32."""
    params = llama.param_infos(spec)
    for layer in params["layers"]:
        layer["post_attn_norm"] = layer["post_mlp_norm"] = layer["attn_norm"]
        for name in NORMS:
            if name in layer:
                layer[name] = dataclasses.replace(layer[name], dtype="float32")
    params["final_norm"] = dataclasses.replace(params["final_norm"], dtype="float32")
    return params


def params_from_hf(tensors: CheckpointTensors, spec: GemmaSpec, dtype: Any) -> Params:
    """Llama's loading (which reads post_attention_layernorm as its "mlp_norm"), then the
    Gemma norms put in their places and stored as 1 + w in float32."""
    params = llama.params_from_hf(tensors, spec, dtype)
    h = spec.hidden_size

    def plus_one(w: np.ndarray) -> np.ndarray:  # w in the model's dtype, 1 + w in float32
        return np.asarray(w).astype(np.float32) + np.float32(1.0)

    for n, layer in enumerate(params["layers"]):
        p = f"model.layers.{n}."
        layer["post_attn_norm"] = layer["mlp_norm"]
        layer["mlp_norm"] = cast(tensors.take(p + "pre_feedforward_layernorm.weight", (h,)), dtype)
        layer["post_mlp_norm"] = cast(
            tensors.take(p + "post_feedforward_layernorm.weight", (h,)), dtype
        )
        for name in NORMS:
            if name in layer:
                layer[name] = plus_one(layer[name])
    params["final_norm"] = plus_one(params["final_norm"])
    return params


# ---- forward ----------------------------------------------------------------------------


def forward(
    params: Params,
    kv_caches: KVCache,
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    logits_indices: jax.Array,  # i32[S]
    meta: AttentionMetadata,
    *,
    spec: GemmaSpec,
    attention: AttentionBackend,
    num_compute_tokens: jax.Array,  # i32[1]
    num_logits_rows: jax.Array,  # i32[1]: the real rows of logits_indices
    need_logits: jax.Array,  # bool[]
    scan_layers: bool = True,
    lora_slots: jax.Array | None = None,  # i32[T]: each token row's LoRA slot (0: none)
) -> tuple[jax.Array, jax.Array | None, KVCache, jax.Array]:
    """One forward pass over a packed ragged batch; the contract of llama.forward."""
    real_tokens = num_compute_tokens[0]
    eps = spec.rms_norm_eps
    global_rope = local_rope = rope_for(spec, positions)
    if spec.local_rope_theta is not None:  # Gemma 3's sliding layers: their own base
        local = dataclasses.replace(
            spec, rope_theta=spec.local_rope_theta, rope_scaling=spec.local_rope_scaling
        )
        local_rope = rope_for(local, positions)
    scale = jnp.asarray(math.sqrt(spec.hidden_size), _embed_dtype(params)).astype(jnp.float32)
    x = embed_tokens(params, input_ids) * scale  # [T, H]
    activation = ACTIVATIONS[spec.activation]

    def layer_fn(layer: Params, carry: tuple, i: Any, kind: int, lora: Any = None) -> tuple:
        x, kv_caches = carry
        window = spec.sliding_windows[kind]
        attn, kv_caches = attention_block(
            layer,
            rms_norm(x, layer["attn_norm"], eps),
            global_rope if window is None else local_rope,
            kv_caches,
            meta,
            spec,
            attention,
            i,
            real_tokens,
            sliding_window=window,
            soft_cap=spec.attn_logit_soft_cap,
            lora=lora,
        )
        x = x + rms_norm(
            project(attn, layer, "wo", real_tokens, lora), layer["post_attn_norm"], eps
        )
        h = mlp(layer, rms_norm(x, layer["mlp_norm"], eps), real_tokens, activation, lora)
        return x + rms_norm(h, layer["post_mlp_norm"], eps), kv_caches

    # (local and global layers alternate: the scan's body holds one period of the pattern)
    x, kv_caches = run_layers(
        params["layers"],
        (x, kv_caches),
        layer_fn,
        kinds=spec.sliding_windows,
        scan=scan_layers,
        lora=lora_rows(lora_slots, params),
    )
    hidden = rms_norm(x, params["final_norm"], eps)  # [T, H]
    logits, greedy = lm_head(params, hidden[logits_indices], num_logits_rows[0], need_logits)
    if spec.final_logit_soft_cap is not None:  # monotonic: the greedy tokens stay
        logits = soft_cap(logits, spec.final_logit_soft_cap)
    return logits, greedy, kv_caches, hidden


def _embed_dtype(params: Params) -> Any:
    """The embedding table's dtype (a bfloat16 table is stored as its uint16 bits on CPU;
    rows read from a quantized head come out float32)."""
    if "embed" not in params:
        return jnp.float32
    embed = params["embed"]
    return jnp.bfloat16 if embed.dtype == jnp.uint16 else embed.dtype


# ---- GGUF -------------------------------------------------------------------------------
# llama.cpp's "gemma2" and "gemma3" archs. Its converter stores every norm weight as 1 + w
# (ggml's RMSNorm scales by the weight itself) and leaves q/k rows in their order (ggml's
# rope for these archs is rotate-half, as Hugging Face's); tensor_from_gguf takes the 1 off
# again, for params_from_hf to add it as for a Hugging Face checkpoint.

GGUF_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

#: GGUF tensor name -> Hugging Face name: Llama's, with the four norms of a Gemma layer
#: (llama.cpp's ffn_norm is the pre-feedforward one, not Llama's post-attention norm)
GGUF_TENSORS = {
    **llama.GGUF_TENSORS,
    "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.pre_feedforward_layernorm.weight",
    "blk.{n}.post_ffw_norm.weight": "model.layers.{n}.post_feedforward_layernorm.weight",
}

#: The hidden size of each arch's 27B model, the one whose queries are scaled by
#: (hidden_size / num_heads) ** -0.5 and not head_dim ** -0.5 (config_from_gguf)
HIDDEN_27B = {"gemma2": 4608, "gemma3": 5376}


def config_from_gguf(metadata: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Llama's mapping of the metadata, plus Gemma's: the soft caps
    (`<arch>.attn_logit_softcapping`, `final_logit_softcapping`), the window
    (`attention.sliding_window`) and which layers slide (`attention.sliding_window_pattern`:
    every pattern-th layer global, or one flag a layer, True sliding, as llama.cpp reads it;
    without it Gemma 2 alternates from a sliding layer 0 and Gemma 3 has five sliding layers
    to a global one), Gemma 3's local rotary base (`rope.freq_base_swa`, else the 10000
    llama.cpp assumes; the linear scaling applies to the global layers only), gelu (tanh).

    query_pre_attn_scalar is not stored. llama.cpp takes head_dim, except for the 27B
    models, where it takes hidden_size / num_heads (their configs' 144 and 168), and so
    does this mapping; it tells the 27B models by their hidden sizes (HIDDEN_27B), llama.cpp
    by their layer counts (46 and 62). Every released Gemma 2 and 3 config follows that
    rule; a fine-tune with another scalar would need its config.json."""
    arch = metadata.require("general.architecture")
    cfg = llama.config_from_gguf(metadata, shapes, GGUF_ARCHS[arch])
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cfg[key] = metadata.get(f"{arch}.{key}")
    cfg["sliding_window"] = metadata.get(f"{arch}.attention.sliding_window")
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:
        layers = range(cfg["num_hidden_layers"])
        sliding = (
            [bool(x) for x in pattern]
            if isinstance(pattern, list)
            else [pattern == 0 or (i + 1) % pattern != 0 for i in layers]
        )
        if len(sliding) != len(layers):
            raise ModelLoadError(
                f"{metadata.path}: {arch}.attention.sliding_window_pattern "
                f"has {len(sliding)} flags for {len(layers)} layers"
            )
        cfg["layer_types"] = [("sliding" if s else "full") + "_attention" for s in sliding]
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = metadata.get(f"{arch}.rope.freq_base_swa", 10000.0)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = hidden / heads if hidden == HIDDEN_27B[arch] else cfg["head_dim"]
    return cfg


def tensor_from_gguf(hf_name: str, x: np.ndarray, *, spec: GemmaSpec, arch: str) -> np.ndarray:
    """A norm weight less the 1 llama.cpp's converter added. In float32, ((1 + w) - 1) + 1
    is the stored 1 + w again, exactly, wherever 1 + w >= 0.5 (the subtraction is exact
    there): an F32 file's norms load as the Hugging Face checkpoint's do, bit for bit."""
    return x - np.float32(1.0) if hf_name.endswith("norm.weight") else x
