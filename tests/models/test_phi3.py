"""Phi-3: LongRoPE's frequencies against transformers', and the fused checkpoint tensors.

The end-to-end greedy parity of both Phi-3 variants (default rope, LongRoPE) is in
tests/e2e/test_parity.py; these pin the pieces: each factor set and the attention factor as
transformers computes them, the per-position choice between them, and the split of
qkv_proj / gate_up_proj into Llama's per-KV-head layout.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.models import phi3, registry
from jaxcb.models.layers import longrope_inv_freq, rope_for
from jaxcb.models.weights import CheckpointTensors, ModelLoadError

ORIGINAL = 64  # original_max_position_embeddings


def phi3_config(head_dim: int = 96, **overrides) -> dict:
    """A Phi-3.5-mini-like config.json (LongRoPE), small: 2 query heads of `head_dim`."""
    rng = np.random.default_rng(1)
    half = head_dim // 2
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 128,
        "hidden_size": 2 * head_dim,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8 * ORIGINAL,
        "original_max_position_embeddings": ORIGINAL,  # beside rope_scaling, as the hub's
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": rng.uniform(1.0, 1.2, half).round(4).tolist(),
            "long_factor": rng.uniform(1.0, 30.0, half).round(4).tolist(),
        },
        "pad_token_id": 0,
        **overrides,
    }


def hf_longrope(cfg: dict):
    """transformers' (short inv_freq, long inv_freq, attention factor) for `cfg`."""
    import transformers
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    config = transformers.Phi3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    short, factor = _compute_longrope_parameters(config)
    long, long_factor = _compute_longrope_parameters(config, seq_len=ORIGINAL + 1)
    assert factor == long_factor
    return short.numpy(), long.numpy(), factor, config


@pytest.mark.parametrize("head_dim", [96, 64])
def test_longrope_parameters_equal_transformers(head_dim: int) -> None:
    cfg = phi3_config(head_dim)
    spec = registry.spec_from_hf_config(cfg)
    assert spec.family == "phi3" and spec.architecture == "Phi3ForCausalLM"
    hash(spec)  # the factor lists became tuples: the spec is static in jit
    short, long, factor = longrope_inv_freq(spec.head_dim, spec.rope_theta, dict(spec.rope_scaling))
    want_short, want_long, want_factor, _ = hf_longrope(cfg)
    # numpy's and torch's float32 pow round a few powers an ulp or two apart, more once
    # multiplied (3 ulps seen with numpy's AVX-512 pow on a Zen 5; 2 on AVX2-only machines)
    np.testing.assert_array_max_ulp(short, want_short, maxulp=4)
    np.testing.assert_array_max_ulp(long, want_long, maxulp=4)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(ORIGINAL)))

    # an explicit attention_factor (or factor) in the config wins, as in transformers
    explicit = {**cfg["rope_scaling"], "attention_factor": 1.25}
    spec = registry.spec_from_hf_config({**cfg, "rope_scaling": explicit})
    assert longrope_inv_freq(head_dim, 10000.0, dict(spec.rope_scaling))[2] == 1.25
    assert hf_longrope({**cfg, "rope_scaling": explicit})[2] == 1.25


def test_each_position_picks_its_factors_like_transformers_rotary_embedding() -> None:
    """Positions under original_max_position_embeddings rotate with the short factors, the
    rest with the long ones, in one call; transformers' rotary embedding gives the same cos
    and sin for a call below that length (short) and for one reaching it (long)."""
    import torch
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = phi3_config()
    spec = registry.spec_from_hf_config(cfg)
    positions = np.array([0, 5, ORIGINAL - 1, ORIGINAL, ORIGINAL + 7, 8 * ORIGINAL - 1])
    cos, sin = (np.asarray(t)[:, 0] for t in rope_for(spec, jnp.asarray(positions, jnp.int32)))
    short = positions < ORIGINAL
    rotary = Phi3RotaryEmbedding(hf_longrope(cfg)[3])
    x = torch.zeros(1, dtype=torch.float32)
    for part in (short, ~short):
        # transformers: one factor set per call; the long one when the call reaches ORIGINAL
        want_cos, want_sin = (
            t[0].numpy() for t in rotary(x, torch.from_numpy(positions[part][None]))
        )
        # Angles reach ~500 radians here: an ulp or two of inv_freq apart (see above) moves
        # cos and sin by a few 1e-6. A wrong factor set moves them by far more (checked below).
        tol = dict(rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cos[part], want_cos, **tol)
        d = spec.head_dim // 2  # rope_tables' sin is signed: [-sin, sin]
        np.testing.assert_allclose(sin[part][:, d:], want_sin[:, d:], **tol)
        np.testing.assert_allclose(sin[part][:, :d], -want_sin[:, :d], **tol)
    # and the two sets do differ there: the test would notice a wrong choice
    s, lg, _ = longrope_inv_freq(spec.head_dim, spec.rope_theta, dict(spec.rope_scaling))
    assert not np.allclose(s, lg)


def test_config_mapping_variants_and_refusals() -> None:
    cfg = phi3_config()
    hub = registry.spec_from_hf_config(cfg)

    def rope_of(spec) -> tuple:
        scaling = dict(spec.rope_scaling)
        short, long, factor = longrope_inv_freq(spec.head_dim, spec.rope_theta, scaling)
        return short.tolist(), long.tolist(), factor, scaling["original_max_position_embeddings"]

    # transformers 5 writes rope_parameters, with original_max_position_embeddings inside
    rope = {**cfg["rope_scaling"], "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "longrope"}
    saved = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")}
    saved["rope_parameters"] = rope | {"original_max_position_embeddings": ORIGINAL}
    assert rope_of(registry.spec_from_hf_config(saved)) == rope_of(hub)
    legacy = registry.spec_from_hf_config({**cfg, "rope_scaling": {**rope, "type": "su"}})
    assert dict(legacy.rope_scaling)["rope_type"] == "longrope"
    assert rope_of(legacy) == rope_of(hub)
    plain = registry.spec_from_hf_config({**cfg, "rope_scaling": None, "sliding_window": 2047})
    assert plain.rope_scaling is None and plain.sliding_windows == (2047,)  # every layer
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.75"):
        registry.spec_from_hf_config({**cfg, "partial_rotary_factor": 0.75})
    short = {**cfg["rope_scaling"], "short_factor": [1.0] * 8}  # head_dim 96 needs 48
    with pytest.raises(ModelLoadError, match="need 48 values"):
        registry.spec_from_hf_config({**cfg, "rope_scaling": short})


def test_fused_tensors_split_into_the_heads_transformers_computes() -> None:
    """Grouped KV heads (6 query heads over 2 KV heads): each query, key and value head, and
    gate and up, computed through the params equal transformers' slicing of the fused
    projections (Phi3Attention.forward, Phi3MLP.forward)."""
    h, d, i, hq, hkv = 48, 8, 64, 6, 2
    cfg = phi3_config(num_attention_heads=hq, num_key_value_heads=hkv, hidden_size=h)
    spec = registry.spec_from_hf_config({**cfg, "rope_scaling": None})
    assert (spec.head_dim, spec.group_size) == (d, 3)
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (128, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (128, h),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.qkv_proj.weight": ((hq + 2 * hkv) * d, h),
        "model.layers.0.self_attn.o_proj.weight": (h, hq * d),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
    }
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    checkpoint = CheckpointTensors(tensors, "test")
    layer = phi3.params_from_hf(checkpoint, spec, np.float32)["layers"][0]
    assert checkpoint.used == set(tensors)  # every tensor read, none left over

    x = rng.standard_normal((5, h)).astype(np.float32)
    qkv = x @ tensors["model.layers.0.self_attn.qkv_proj.weight"].T  # transformers' slicing
    want_q = qkv[:, : hq * d].reshape(5, hq, d)
    want_k = qkv[:, hq * d : (hq + hkv) * d].reshape(5, hkv, d)
    want_v = qkv[:, (hq + hkv) * d :].reshape(5, hkv, d)
    got = (x @ layer["wqkv"].reshape(h, -1)).reshape(5, hkv, hq // hkv + 2, d)  # as forward
    np.testing.assert_allclose(got[:, :, :-2].reshape(5, hq, d), want_q, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[:, :, -2], want_k, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[:, :, -1], want_v, rtol=1e-5, atol=1e-4)

    gate, up = np.split(x @ tensors["model.layers.0.mlp.gate_up_proj.weight"].T, 2, axis=-1)
    got = np.einsum("th,hci->tci", x, layer["w_gate_up"])
    np.testing.assert_allclose(got[:, 0], gate, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[:, 1], up, rtol=1e-5, atol=1e-4)

    del tensors["model.layers.0.self_attn.qkv_proj.weight"]
    with pytest.raises(ModelLoadError, match="qkv_proj"):
        phi3.params_from_hf(CheckpointTensors(tensors, "test"), spec, np.float32)
