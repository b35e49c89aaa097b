"""The two sub-layers every family builds its decoder layers from, over the paged KV cache
and the model code's matmuls (packed.py): attention (`attention_block`: the fused q/k/v
projection, optional biases and q/k norms, rotary embeddings, the new K/V written into the
layer's pages, ragged paged attention through the attention backend) and the gated MLP
(`mlp`: SwiGLU, or GeGLU for Gemma). The families wire them with their own norms and
residuals (llama.py's forward, gemma.py's, moe.py's around its sparse feed-forward).

The weights are those llama.py declares (`param_infos`): `wqkv [H, Hkv, G + 2, D]` grouped
per KV head (its G query heads, then K, then V), `bqkv [Hkv, G + 2, D]`, `q_norm` / `k_norm
[D]`, `w_gate_up [H, 2, I]`, `w_down [I, H]`; each may be packed for a native kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.lora import LoraRows, add_adapters
from jaxcb.models.base import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    ModelSpec,
    Params,
    layer_metadata,
)
from jaxcb.models.layers import apply_rope, precision, rms_norm
from jaxcb.models.packed import Normed, matmul, native_weight, packed_swiglu


def attention_block(
    layer: Params,
    h: jax.Array,  # f32[T, H]: the normed residual
    rope: tuple[jax.Array, jax.Array],
    caches: KVCache,
    meta: AttentionMetadata,
    spec: ModelSpec,
    attention: AttentionBackend,
    index: Any,
    real_tokens: jax.Array,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    lora: LoraRows | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Layer `index`'s (an int, or traced in a scan) attention output [T, Hq * D] (before
        wo) and the pool with its new K/V written (`caches`: every layer's pages, and their
        scales for quantized pages: then (k, v, k_scales, v_scales)). `sliding_window`: the
        layer's (None: full attention). `soft_cap`: attention scores become
        soft_cap * tanh(score / soft_cap) (Gemma 2). `lora`: the token rows' adapters
    (jaxcb/lora.py's `lora_rows`), or None: the base weights only."""
    num_tokens, g, d = h.shape[0], spec.group_size, spec.head_dim
    per_layer = isinstance(caches, list)  # (unrolled layers: a pool per layer)
    pool = caches[index] if per_layer else caches
    if not per_layer:
        meta = layer_metadata(meta, caches, index, spec.num_layers)
    qkv = project(h, layer, "wqkv", real_tokens, lora)  # [T, Hkv * (G + 2) * D]
    qkv = qkv.reshape(num_tokens, spec.num_kv_heads, g + 2, d)  # [T, Hkv, G + 2, D]
    if "bqkv" in layer:
        qkv = qkv + layer["bqkv"].astype(jnp.float32)
    q = qkv[:, :, :g].reshape(num_tokens, spec.num_q_heads, d)  # [T, Hq, D]
    k = qkv[:, :, g]  # [T, Hkv, D]
    v = qkv[:, :, g + 1]  # [T, Hkv, D]
    if spec.qk_norm:
        q = rms_norm(q, layer["q_norm"], spec.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], spec.rms_norm_eps)
    q = apply_rope(q, rope)
    k = apply_rope(k, rope)
    k_pages, v_pages, *scales = attention.write_kv(*pool[:2], k, v, meta.slot_mapping, *pool[2:])
    # q in the pages' float dtype; with quantized pages (codes and scales) q stays float.
    out = attention.attend(
        q if scales else q.astype(k_pages.dtype),
        k_pages,
        v_pages,
        meta.kv_lens,
        meta.page_indices,
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=spec.sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pool_layers=1 if per_layer else spec.num_layers,  # (the kernels' cost: one layer's)
        **dict(zip(("k_scales", "v_scales"), scales, strict=False)),
    )  # [T, Hq, D]
    pool = (k_pages, v_pages, *scales)
    if per_layer:
        return out.reshape(num_tokens, -1), [*caches[:index], pool, *caches[index + 1 :]]
    return out.reshape(num_tokens, -1), pool


def project(
    x: jax.Array | Normed,
    layer: Params,
    name: str,
    real_tokens: jax.Array,
    lora: LoraRows | None = None,
) -> jax.Array:
    """x @ layer[name] (packed.matmul), plus each row's LoRA adapter term when `lora` (the
    rows' adapters) is given and the layer carries slot arrays for the weight."""
    y = matmul(x, layer[name], real_tokens)
    if _adapted(layer, name, lora):
        native_base = native_weight(layer[name]) is not None
        y = add_adapters(y, x, layer["lora"], name, lora, real_tokens, native_base=native_base)
    return y


def _adapted(layer: Params, name: str, lora: LoraRows | None) -> bool:
    return lora is not None and "lora" in layer and name in layer["lora"].stack


#: Buckets of at least this many rows take the fused SwiGLU kernel when no row has an adapter
#: (a lax.cond on it): unfused, a prefill step writes and reads [T, 2 * I] float32 gate/up
#: outputs, which prefill-heavy passes without adapters paid (`bench lora`'s base passes,
#: ~0.93x of no LoRA); at decode's few rows that costs less than a taken branch (~40 us).
FUSED_WITHOUT_ADAPTERS_ROWS = 128


def mlp(
    layer: Params,
    h: jax.Array,
    real_tokens: jax.Array,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    lora: LoraRows | None = None,
) -> jax.Array:
    """down(activation(gate(h)) * up(h)) for the normed residual h [T, H]: SwiGLU, or GeGLU
    with a gelu `activation` (Gemma). `lora`: as attention_block's (gate and up then come
    out of the matmul apart, to take the adapters' terms before the activation; a bucket of
    FUSED_WITHOUT_ADAPTERS_ROWS or more takes the fused kernel when no row has an adapter)."""
    w = layer["w_gate_up"]  # [H, 2, I]
    adapted = _adapted(layer, "w_gate_up", lora)
    swiglu = packed_swiglu(w) if activation is jax.nn.silu else None
    if swiglu is not None and not adapted:  # the activation in the matmul's epilogue
        act = swiglu(h, real_tokens)
    elif isinstance(w, dict) or native_weight(w) is not None:  # packed [H, 2 * I]; quantized

        def apart(h: jax.Array | Normed) -> jax.Array:
            gate_up = project(h, layer, "w_gate_up", real_tokens, lora)
            gate_up = gate_up.reshape(h.shape[0], 2, -1)
            return activation(gate_up[:, 0]) * gate_up[:, 1]

        if swiglu is not None and h.shape[0] >= FUSED_WITHOUT_ADAPTERS_ROWS:
            fused = jax.eval_shape(lambda: swiglu(h, real_tokens))  # (h: a Normed's eps static)
            act = jax.lax.cond(
                lora.active, lambda: apart(h).astype(fused.dtype), lambda: swiglu(h, real_tokens)
            )
        else:
            act = apart(h)
    else:
        # Gate and up in one matmul, without merging (2, I) into one axis: tensor parallelism
        # shards I, and a merged 2 * I axis would not be sharded evenly (XLA would gather w).
        x = h.value() if isinstance(h, Normed) else h
        gate_up = jnp.einsum(
            "th,hci->tci",
            x.astype(w.dtype),
            w,
            preferred_element_type=jnp.float32,
            precision=precision(w.dtype),
        )  # [T, 2, I]
        if adapted:  # (the term [T, 2, I] too)
            gate_up = add_adapters(
                gate_up, x, layer["lora"], "w_gate_up", lora, real_tokens, native_base=False
            )
        act = activation(gate_up[:, 0]) * gate_up[:, 1]
    return project(act, layer, "w_down", real_tokens, lora)
