"""The Llama family: Llama 2/3, Mistral, Qwen2 and Qwen3, over a paged KV cache.

The forward pass takes a packed, ragged batch of tokens (prefill chunks and decode tokens of
many requests on one axis), writes each layer's new K/V into the page pool, runs ragged paged
attention, and returns logits only at the rows that are sampled. The variants differ in
three switches of the spec: q/k/v biases (Qwen2), RMSNorm of q and k per head (Qwen3), and
sliding-window layers (Mistral; Qwen2/3 when the config enables them).

Parameters (`param_infos`; projections stored [in, out]): q/k/v are grouped per KV head,
`wqkv [H, Hkv, G + 2, D]` (its G query heads, then K, then V), so one matmul computes all
three and tensor parallelism shards the KV-head axis without splitting a group.

A layer's attention and MLP are sublayers.py's, which the other families build on too; this
file maps the checkpoints (Hugging Face and GGUF) onto them and wires the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxcb.lora import lora_rows
from jaxcb.models.base import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    ModelSpec,
    ParamInfo,
    Params,
)
from jaxcb.models.layers import rms_norm, rope_for
from jaxcb.models.packed import embed_tokens, lm_head, normed
from jaxcb.models.stacking import run_layers
from jaxcb.models.sublayers import attention_block, mlp, project
from jaxcb.models.weights import CheckpointTensors, ConfigFields, ModelLoadError, cast

#: Hugging Face class -> variant
VARIANTS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ARCHITECTURES = tuple(VARIANTS)
MODEL_TYPES = {variant: arch for arch, variant in VARIANTS.items()}
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


# ---- config -----------------------------------------------------------------------------


def spec_from_hf_config(cfg: dict[str, Any], architecture: str) -> ModelSpec:
    """Map a Hugging Face config.json of `architecture` onto the facts the forward needs."""
    variant = VARIANTS[architecture]
    f = ConfigFields(cfg)
    if f.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu'")
    hidden = f.integer("hidden_size")
    num_heads = f.integer("num_attention_heads")
    num_layers = f.integer("num_hidden_layers")
    num_kv_heads = f.integer("num_key_value_heads", num_heads)
    for name, value in [("hidden_size", hidden), ("num_attention_heads", num_heads)]:
        if value < 1:
            raise ModelLoadError(f"config.json: {name} must be >= 1, got {value}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads={num_heads} is not divisible by "
            f"num_key_value_heads={num_kv_heads}"
        )
    eos = f.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope_theta, scaling = rope_from_config(cfg, f)
    return ModelSpec(
        family="llama",
        architecture=architecture,
        vocab_size=f.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size"),
        num_layers=num_layers,
        num_q_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=f.integer("head_dim", hidden // num_heads),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        qkv_bias=variant == "qwen2" or f.flag("attention_bias", False),
        qk_norm=variant == "qwen3",
        sliding_windows=_sliding_windows(f, variant, num_layers),
        max_position_embeddings=f.integer("max_position_embeddings", 2048),
        bos_token_id=f.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def rope_from_config(cfg: dict[str, Any], f: ConfigFields) -> tuple[float, tuple | None]:
    """rope_theta and the scaling (as sorted items), from `rope_parameters` (transformers 5)
    or `rope_theta` / `rope_scaling`."""
    rope = dict(f.get("rope_parameters", {}))
    theta = ConfigFields(rope, "config.json rope_parameters").number("rope_theta", None)
    if theta is None:
        theta = f.number("rope_theta", 10000.0)
    scaling = f.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "longrope":  # (Phi-3) layers.rope_for reads these two; older configs
        # keep original_max_position_embeddings beside rope_scaling, not in it
        if scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = f.integer(
                "original_max_position_embeddings"
            )
        if scaling.get("factor") is None:
            extended = f.integer("max_position_embeddings", 2048)
            scaling["factor"] = extended / scaling["original_max_position_embeddings"]
    # lists (LongRoPE's factors) as tuples: the spec is hashable, a static argument of jit
    items = ((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items())
    return theta, tuple(sorted(items))


def _sliding_windows(f: ConfigFields, variant: str, num_layers: int) -> tuple[int | None, ...]:
    window = f.integer("sliding_window", 0)
    if variant == "mistral":
        return (window or None,) * num_layers
    if variant in ("qwen2", "qwen3") and f.get("use_sliding_window") and window:
        layer_types = f.get("layer_types")
        if layer_types:
            return tuple(window if t == "sliding_attention" else None for t in layer_types)
        first_full = f.integer("max_window_layers", num_layers)
        return tuple(window if i >= first_full else None for i in range(num_layers))
    return (None,) * num_layers


# ---- parameters -------------------------------------------------------------------------


def param_infos(spec: ModelSpec) -> Params:
    """Every parameter's shape and logical axes (runtime/sharding.py maps them to the mesh)."""
    h, d, i, v = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.vocab_size
    hq, hkv, g = spec.num_q_heads, spec.num_kv_heads, spec.group_size
    layer = {
        "attn_norm": ParamInfo((h,), ("embed",)),
        "wqkv": ParamInfo((h, hkv, g + 2, d), ("embed", "kv_heads", "qkv", "head_dim"), True),
        # rows are head-major: a block of rows is a block of query heads
        "wo": ParamInfo((hq * d, h), ("q_heads", "embed"), True),
        "mlp_norm": ParamInfo((h,), ("embed",)),
        "w_gate_up": ParamInfo((h, 2, i), ("embed", "gate_up", "mlp"), True),
        "w_down": ParamInfo((i, h), ("mlp", "embed"), True),
    }
    if spec.qkv_bias:
        layer["bqkv"] = ParamInfo((hkv, g + 2, d), ("kv_heads", "qkv", "head_dim"))
    if spec.qk_norm:
        layer["q_norm"] = ParamInfo((d,), ("head_dim",))
        layer["k_norm"] = ParamInfo((d,), ("head_dim",))
    params: Params = {
        "embed": ParamInfo((v, h), ("vocab", "embed")),
        "layers": [dict(layer) for _ in range(spec.num_layers)],
        "final_norm": ParamInfo((h,), ("embed",)),
    }
    if not spec.tie_word_embeddings:
        params["lm_head"] = ParamInfo((h, v), ("embed", "vocab"), True)
    return params


def params_from_hf(
    tensors: CheckpointTensors,
    spec: ModelSpec,
    dtype: Any,
    mlp_from_hf: Callable[[int], Params] | None = None,
) -> Params:
    """The params pytree (host arrays of `dtype`) from a Hugging Face checkpoint's tensors:
    q/k/v fused per KV head, gate/up stacked, projections transposed to [in, out].
    `mlp_from_hf(n)`: layer n's feed-forward params, already of `dtype` (a family that reuses
    this attention with its own FFN: moe.py); default the dense MLP under "mlp."."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hq, hkv, g = spec.num_q_heads, spec.num_kv_heads, spec.group_size
    take = tensors.take
    if mlp_from_hf is None:

        def mlp_from_hf(n: int) -> Params:
            return dense_mlp_from_hf(tensors, f"model.layers.{n}.mlp.", (h, i), dtype)

    layers = []
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        wq = take(p + "self_attn.q_proj.weight", (hq * d, h)).T.reshape(h, hkv, g, d)
        wk = take(p + "self_attn.k_proj.weight", (hkv * d, h)).T.reshape(h, hkv, 1, d)
        wv = take(p + "self_attn.v_proj.weight", (hkv * d, h)).T.reshape(h, hkv, 1, d)
        layer = {
            "attn_norm": take(p + "input_layernorm.weight", (h,)),
            "wqkv": np.concatenate([wq, wk, wv], axis=2),  # [H, Hkv, G + 2, D]
            "wo": take(p + "self_attn.o_proj.weight", (h, hq * d)).T,
            "mlp_norm": take(p + "post_attention_layernorm.weight", (h,)),
        }
        if spec.qkv_bias:
            bq = take(p + "self_attn.q_proj.bias", (hq * d,)).reshape(hkv, g, d)
            bk = take(p + "self_attn.k_proj.bias", (hkv * d,)).reshape(hkv, 1, d)
            bv = take(p + "self_attn.v_proj.bias", (hkv * d,)).reshape(hkv, 1, d)
            layer["bqkv"] = np.concatenate([bq, bk, bv], axis=1)  # [Hkv, G + 2, D]
        if spec.qk_norm:
            layer["q_norm"] = take(p + "self_attn.q_norm.weight", (d,))
            layer["k_norm"] = take(p + "self_attn.k_norm.weight", (d,))
        layers.append({k: cast(x, dtype) for k, x in layer.items()} | mlp_from_hf(n))

    params: Params = {
        "embed": cast(take("model.embed_tokens.weight", (spec.vocab_size, h)), dtype),
        "layers": layers,
        "final_norm": cast(take("model.norm.weight", (h,)), dtype),
    }
    if not spec.tie_word_embeddings:
        params["lm_head"] = cast(take("lm_head.weight", (spec.vocab_size, h)).T, dtype)
    else:
        tensors.skip("lm_head.weight")  # some tied checkpoints store a copy anyway
    return params


def dense_mlp_from_hf(
    tensors: CheckpointTensors, prefix: str, size: tuple[int, int], dtype: Any
) -> Params:
    """A SwiGLU MLP's w_gate_up [H, 2, I] and w_down [I, H] (of `dtype`) from its
    gate_proj / up_proj / down_proj under `prefix`; `size` is (H, I)."""
    h, i = size
    gate = tensors.take(prefix + "gate_proj.weight", (i, h)).T
    up = tensors.take(prefix + "up_proj.weight", (i, h)).T
    return {
        "w_gate_up": cast(np.stack([gate, up], axis=1), dtype),  # [H, 2, I]
        "w_down": cast(tensors.take(prefix + "down_proj.weight", (h, i)).T, dtype),
    }


# ---- GGUF -------------------------------------------------------------------------------
# llama.cpp's names for this family's tensors and hyperparameters (its convert_hf_to_gguf.py).
# The loader renames the tensors to Hugging Face's (GGUF_TENSORS; dequantized, a matrix is
# [out, in] as there), undoes llama.cpp's q/k row order (tensor_from_gguf) and hands them to
# params_from_hf; the metadata becomes a Hugging Face config (config_from_gguf).

#: GGUF tensor name -> Hugging Face name; "{n}" stands for the layer index
GGUF_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
    "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
    "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
} | {
    f"blk.{{n}}.attn_{x}.{kind}": f"model.layers.{{n}}.self_attn.{x}_proj.{kind}"
    for x in "qkv"
    for kind in ("weight", "bias")
}

#: GGUF metadata key (after "<arch>.") -> Hugging Face config field; the first four required
GGUF_CONFIG = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


def config_from_gguf(
    metadata: Any, shapes: dict[str, tuple[int, ...]], architecture: str | None = None
) -> dict[str, Any]:
    """A Hugging Face config for a GGUF file of this family, from its metadata (a
    gguf.GGUFMetadata) and tensor shapes; spec_from_hf_config maps it. `architecture`: that
    of a family reusing this mapping (phi3), else this family's for the file's arch."""
    arch = metadata.require("general.architecture")
    architecture = architecture or GGUF_ARCHS[arch]  # Mistral's files say "llama"
    model_type = VARIANTS.get(architecture, arch)
    cfg: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for i, (key, field) in enumerate(GGUF_CONFIG.items()):
        value = metadata.require(f"{arch}.{key}") if i < 4 else metadata.get(f"{arch}.{key}")
        if value is not None:
            cfg[field] = value
    rope_dims = metadata.get(f"{arch}.rope.dimension_count")
    cfg.setdefault("head_dim", rope_dims or cfg["hidden_size"] // cfg["num_attention_heads"])
    if rope_dims not in (None, cfg["head_dim"]):
        raise ModelLoadError(
            f"{metadata.path}: rotary embeddings over {rope_dims} of {cfg['head_dim']} head "
            "dimensions are not supported"
        )
    if "rope_freqs.weight" in shapes:
        raise ModelLoadError(
            f"{metadata.path} scales rotary frequencies by a rope_freqs tensor (Llama 3.1 "
            "style), which jaxcb does not read yet"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"{metadata.path}: unsupported rope scaling {scaling!r}")
    if scaling == "linear":
        factor = metadata.require(f"{arch}.rope.scaling.factor")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    cfg.setdefault("vocab_size", shapes.get("token_embd.weight", (None,))[0])
    cfg["tie_word_embeddings"] = "output.weight" not in shapes
    cfg["attention_bias"] = "blk.0.attn_q.bias" in shapes
    cfg["bos_token_id"] = metadata.get("tokenizer.ggml.bos_token_id")
    cfg["eos_token_id"] = metadata.get("tokenizer.ggml.eos_token_id")
    return cfg


def tensor_from_gguf(hf_name: str, x: np.ndarray, *, spec: ModelSpec, arch: str) -> np.ndarray:
    """Undo llama.cpp's row order of q and k. For the "llama" arch its converter reorders
    each head's rows from Hugging Face's rotate-half layout to interleaved pairs, which
    ggml's rope wants: rows (half, i) become (i, half). transformers' GGUF loader undoes it
    the same way; the qwen archs use rotate-half in ggml too and are not reordered."""
    if arch != "llama" or not hf_name.endswith(
        ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
    ):
        return x
    heads = spec.num_q_heads if ".q_proj." in hf_name else spec.num_kv_heads
    return x.reshape(heads, -1, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


# ---- forward ----------------------------------------------------------------------------


def forward(
    params: Params,
    kv_caches: KVCache,
    input_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    logits_indices: jax.Array,  # i32[S]: rows whose next token is sampled
    meta: AttentionMetadata,
    *,
    spec: ModelSpec,
    attention: AttentionBackend,
    num_compute_tokens: jax.Array,  # i32[1]
    num_logits_rows: jax.Array,  # i32[1]: the real rows of logits_indices
    need_logits: jax.Array,  # bool[]: whether anything but the greedy tokens is read
    scan_layers: bool = True,
    lora_slots: jax.Array | None = None,  # i32[T]: each token row's LoRA slot (0: none)
) -> tuple[jax.Array, jax.Array | None, KVCache, jax.Array]:
    """One forward pass over a packed ragged batch: f32[S, V] logits, their greedy tokens
    (i32[S]) when the LM head's kernel computes them on the way (else None), new caches,
    and the final normed hidden states of every token row (f32[T, H], for prompt logprobs).
    `scan_layers`: the layers run as a lax.scan over their stacked weights (compiled once),
    else unrolled (models/stacking.py).

    The native matmuls compute only the first `num_compute_tokens` token rows (the real ones,
    plus a batching baseline's padding, which is charged that way) and the first num_logits_rows
    sampled rows; the rest of the bucket is padding and comes out zero (a 150-token step in a
    192 bucket, 5 sequences of a prefill step in 128 LM-head rows)."""
    real_tokens = num_compute_tokens[0]
    rope = rope_for(spec, positions)
    # The residual stream stays float32 whatever the weights' dtype; only matmul inputs and
    # the KV pages take the narrow dtype.
    x = embed_tokens(params, input_ids)  # [T, H]

    def layer_fn(layer: Params, carry: tuple, i: Any, kind: int, lora: Any = None) -> tuple:
        x, kv_caches = carry
        # (left to the int8 / int4 kernels of the next matmul where they take it: `normed`)
        h = normed(x, layer["attn_norm"], spec.rms_norm_eps, layer["wqkv"])
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
        h = normed(x, layer["mlp_norm"], spec.rms_norm_eps, layer["w_gate_up"])
        return x + mlp(layer, h, real_tokens, lora=lora), kv_caches

    x, kv_caches = run_layers(
        params["layers"],
        (x, kv_caches),
        layer_fn,
        kinds=spec.sliding_windows,
        scan=scan_layers,
        lora=lora_rows(lora_slots, params),
    )
    hidden = rms_norm(x, params["final_norm"], spec.rms_norm_eps)  # [T, H]
    logits, greedy = lm_head(params, hidden[logits_indices], num_logits_rows[0], need_logits)
    return logits, greedy, kv_caches, hidden
