"""The Gemma family beyond greedy parity (tests/e2e/test_parity.py runs that): configs in
transformers 4's layout as released checkpoints ship them, the (1 + w) norms, and the final
logit soft cap reaching every logit a user sees (sampled tokens' and prompt logprobs)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_hf_model

from jaxcb import LLM, SamplingParams
from jaxcb.models import registry
from jaxcb.models.gemma import GemmaSpec
from jaxcb.models.loading.loader import load_params

GEMMA3_1B = {  # the layout of google/gemma-3-1b-it's config.json (transformers 4.50)
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "rms_norm_eps": 1e-06,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
}

GEMMA2_2B = {  # google/gemma-2-2b's (transformers 4.42): no layer_types
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "rms_norm_eps": 1e-06,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def test_gemma3_released_config():
    spec = registry.spec_from_hf_config(GEMMA3_1B)
    assert isinstance(spec, GemmaSpec) and spec.family == "gemma"
    assert spec.qk_norm and spec.tie_word_embeddings
    assert spec.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert (spec.rope_theta, spec.rope_scaling) == (1000000, None)
    assert (spec.local_rope_theta, spec.local_rope_scaling) == (10000, None)
    assert spec.sm_scale == 256**-0.5 and spec.attn_logit_soft_cap is None
    assert spec.eos_token_ids == (1, 106)


def test_gemma3_4b_global_rope_scaling():
    cfg = dict(GEMMA3_1B, rope_scaling={"rope_type": "linear", "factor": 8.0})
    spec = registry.spec_from_hf_config(cfg)
    assert dict(spec.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert spec.local_rope_scaling is None  # sliding layers keep unscaled rotations


def test_gemma2_released_config():
    spec = registry.spec_from_hf_config(GEMMA2_2B)
    assert spec.sliding_windows == tuple(4096 if i % 2 == 0 else None for i in range(26))
    assert (spec.attn_logit_soft_cap, spec.final_logit_soft_cap) == (50.0, 30.0)
    assert not spec.qk_norm and spec.local_rope_theta is None


def test_unsupported_activation_is_one_line():
    with pytest.raises(ValueError, match="unsupported hidden_activation 'relu'"):
        registry.spec_from_hf_config(dict(GEMMA2_2B, hidden_activation="relu"))


def test_norms_are_one_plus_w_in_float32(tmp_path):
    import torch

    model = make_hf_model("gemma3", tmp_path)
    with torch.no_grad():
        model.model.layers[0].post_feedforward_layernorm.weight.fill_(0.25)
        model.model.layers[1].self_attn.k_norm.weight.fill_(-0.5)
    model.save_pretrained(tmp_path)
    spec = registry.spec_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    layers = load_params(tmp_path, spec, jnp.bfloat16)["layers"]
    assert layers[0]["post_mlp_norm"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(layers[0]["post_mlp_norm"]), 1.25)
    np.testing.assert_array_equal(np.asarray(layers[1]["k_norm"]), 0.5)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    model = make_hf_model("gemma2", path)
    # Two buckets: a 40-token prompt in one step, then decode steps.
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=128,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=[4, 64],
    )
    return model, llm


def test_logprobs_are_soft_capped(gemma2):
    """Sampled tokens' logprobs and prompt logprobs: transformers' log-softmax of the capped
    logits (the cap is 3.0: uncapped logits would differ by far more than the tolerance)."""
    import torch

    model, llm = gemma2
    prompt = np.random.default_rng(0).integers(3, 500, size=40).tolist()
    sp = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    tokens = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    assert float(logits.abs().max()) < 3.0  # capped
    ref = torch.log_softmax(logits, dim=-1).numpy()
    got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    rows = np.arange(len(prompt) - 1, len(tokens) - 1)
    want = ref[rows, tokens[len(prompt) :]]
    np.testing.assert_allclose(out.outputs[0].logprobs, want, atol=1e-4, rtol=0)
