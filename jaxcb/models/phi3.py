"""Phi-3 and Phi-3.5-mini (Phi3ForCausalLM): a Llama with fused checkpoint tensors.

The forward, the params and their sharding are Llama's (llama.py); only the checkpoint
differs. It stores q/k/v as one `self_attn.qkv_proj.weight` [(Hq + 2 Hkv) D, H] (the query
rows, then the key rows, then the value rows) and gate/up as one `mlp.gate_up_proj.weight`
[2 I, H] (gate rows, then up rows). `_Unfused` cuts them into the tensors Llama's
params_from_hf reads, which lays them out per KV head as ever. The config maps as Mistral's:
a `sliding_window` applies to every layer (Phi-3-mini-4k's is 2047).

RoPE: Phi-3-mini-4k uses the default; Phi-3-mini-128k and Phi-3.5-mini use LongRoPE
(short/long factors per frequency and an attention factor on cos and sin, layers.rope_for).
jaxcb picks the long factors for the tokens at positions >= original_max_position_embeddings
and the short ones below, token by token, as vLLM does. transformers picks one set for a
whole forward call (long once the call reaches that length, with the keys cached by earlier
calls kept as they were), a function of how the calls chunk the sequence, which a
continuous-batching engine with chunked prefill and prefix caching cannot reproduce. Both
agree on any sequence shorter than original_max_position_embeddings (4096 for Phi-3); past
it, jaxcb's cache is what one would compute for each position alone.

GGUF: llama.cpp's "phi3" arch stores the same fused tensors (attn_qkv; ffn_up holds gate
and up). Files with LongRoPE keep its factors as tensors (rope_factors_long/short), which the
config mapping cannot read: those are refused.

partial_rotary_factor < 1 (Phi-4-mini rotates only part of each head) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxcb.models import llama
from jaxcb.models.base import ModelSpec, Params
from jaxcb.models.layers import longrope_inv_freq
from jaxcb.models.weights import CheckpointTensors, ModelLoadError

ARCHITECTURES = ("Phi3ForCausalLM",)
MODEL_TYPES = {"phi3": "Phi3ForCausalLM"}
GGUF_ARCHS = {"phi3": "Phi3ForCausalLM"}

# Llama's, as they are (tensor_from_gguf leaves the "phi3" arch's rows in their order)
param_infos = llama.param_infos
forward = llama.forward
tensor_from_gguf = llama.tensor_from_gguf


def spec_from_hf_config(cfg: dict[str, Any], architecture: str) -> ModelSpec:
    """Llama's mapping with Mistral's sliding windows (every layer); transformers' legacy
    names of LongRoPE ("su", "yarn") read as "longrope", as its Phi3Config does."""
    cfg = dict(cfg)
    rotary = {cfg.get("partial_rotary_factor")}
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        rotary.add(rope.get("partial_rotary_factor"))
        if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
            cfg[key] = {**rope, "rope_type": "longrope", "type": "longrope"}
    if rotary - {None, 1.0}:
        raise ModelLoadError(
            f"partial_rotary_factor {min(rotary - {None})} (rotary embeddings over part of each "
            "head, Phi-4-mini) is not supported"
        )
    spec = llama.spec_from_hf_config(cfg, "MistralForCausalLM")
    if spec.rope_scaling and "long_factor" in dict(spec.rope_scaling):  # LongRoPE
        try:  # factor lists of the wrong length fail here, not in the first step's trace
            longrope_inv_freq(spec.head_dim, spec.rope_theta, dict(spec.rope_scaling))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json: bad longrope rope_scaling: {exc}") from None
    return dataclasses.replace(spec, family="phi3", architecture=architecture)


class _Unfused:
    """A checkpoint's tensors (CheckpointTensors or GGUF's) under Llama's names: q/k/v_proj
    and gate/up_proj are row blocks of Phi-3's qkv_proj and gate_up_proj. Each block takes
    the fused tensor again (a view: nothing is copied until params_from_hf lays it out)."""

    def __init__(self, tensors: CheckpointTensors, spec: ModelSpec) -> None:
        q, kv = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        i = spec.intermediate_size
        self.tensors = tensors
        # Llama's name -> (Phi-3's, first row, end row, the fused tensor's rows)
        self.blocks = {
            ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0, q, q + 2 * kv),
            ".self_attn.k_proj.": (".self_attn.qkv_proj.", q, q + kv, q + 2 * kv),
            ".self_attn.v_proj.": (".self_attn.qkv_proj.", q + kv, q + 2 * kv, q + 2 * kv),
            ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0, i, 2 * i),
            ".mlp.up_proj.": (".mlp.gate_up_proj.", i, 2 * i, 2 * i),
        }

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        for part, (fused, start, end, rows) in self.blocks.items():
            if part in name:
                return self.tensors.take(name.replace(part, fused), (rows, *shape[1:]))[start:end]
        return self.tensors.take(name, shape)

    def skip(self, name: str) -> None:
        self.tensors.skip(name)


def params_from_hf(tensors: CheckpointTensors, spec: ModelSpec, dtype: Any) -> Params:
    """Llama's params from Phi-3's fused q/k/v and gate/up tensors."""
    return llama.params_from_hf(_Unfused(tensors, spec), spec, dtype)


# ---- GGUF -------------------------------------------------------------------------------

#: GGUF tensor name -> Hugging Face name: Llama's, with the fused q/k/v and gate/up
GGUF_TENSORS = {
    **llama.GGUF_TENSORS,
    "blk.{n}.attn_qkv.weight": "model.layers.{n}.self_attn.qkv_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.gate_up_proj.weight",
}


def config_from_gguf(metadata: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Llama's mapping of the metadata, plus the sliding window; LongRoPE files refused."""
    if "rope_factors_long.weight" in shapes or "rope_factors_short.weight" in shapes:
        raise ModelLoadError(
            f"{metadata.path} stores LongRoPE factors as tensors (rope_factors_long/short), "
            "which jaxcb does not read from GGUF files yet; load the Hugging Face checkpoint"
        )
    cfg = llama.config_from_gguf(metadata, shapes, "Phi3ForCausalLM")
    cfg["sliding_window"] = metadata.get("phi3.attention.sliding_window")
    return cfg
