"""Every family's whole step compiled for TPU (Mosaic) and H100 (Triton) without the hardware:
what each needs from the attention kernels (head_dim 96 and 256, soft caps, per-layer
windows) and from XLA (the experts' grouped matmuls) lowers and fits. One bucket each; the
general checks of a compiled build live in test_aot_compile.py."""

from __future__ import annotations

import json

import pytest
from test_aot_compile import HAS_CUDA, HAS_TPU

from jaxcb.config import EngineConfig
from jaxcb.runtime import aot, aot_report, hbm_traffic

BASE = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}
MODELS = {
    "gemma2": {  # head_dim 256, both soft caps, a sliding and a global layer
        "architectures": ["Gemma2ForCausalLM"],
        "head_dim": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 64,
        "query_pre_attn_scalar": 256,
    },
    "gemma3": {  # q/k norms, two rotary tables
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": 128,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
    "phi3": {"architectures": ["Phi3ForCausalLM"], "head_dim": 96, "hidden_size": 384},
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "head_dim": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
    },
}
TPU = pytest.mark.skipif(not HAS_TPU, reason="jax[tpu] (libtpu) is not installed")
CUDA = pytest.mark.skipif(not HAS_CUDA, reason="jax[cuda12] is not installed")
# Each family on one target, Gemma 2 (head_dim 256, soft caps) on both: the suite's time.
# head_dim 96 on TPU is in tests/kernels/test_rpa_tpu_compile.py.
CASES = [
    pytest.param("gemma2", "v5e:1x1", "tpu_custom_call", marks=TPU),
    pytest.param("gemma2", "h100", aot_report.TRITON_CALL, marks=CUDA),
    pytest.param("gemma3", "v5e:1x1", "tpu_custom_call", marks=TPU),
    pytest.param("phi3", "h100", aot_report.TRITON_CALL, marks=CUDA),
    pytest.param("mixtral", "h100", aot_report.TRITON_CALL, marks=CUDA),
    pytest.param("qwen3-moe", "v5e:1x1", "tpu_custom_call", marks=TPU),
]
ONE_BUCKET = dict(
    dtype="bfloat16",
    max_model_len=256,
    page_size=16,
    token_buckets=(32,),
    max_num_batched_tokens=32,
    max_num_seqs=8,
    seq_buckets=(),
    num_pages=64,
)


@pytest.mark.parametrize(("family", "target", "kernel_call"), CASES)
def test_family_compiles_for_target(tmp_path, family, target, kernel_call):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **MODELS[family]}))
    config = EngineConfig.from_dict(None, model=str(path), **ONE_BUCKET)
    build = aot.compile_for_target(config, aot.get_target(target))
    rep = aot_report.report(build)
    assert rep.fits and all(b.fits for b in rep.buckets)
    assert rep.attention.startswith("pallas-")
    hlo = build.runner.programs.compiled_step(build.buckets[0]).as_text()
    # attention through the Pallas kernel (on TPU the experts' ragged_dot is a Mosaic call too)
    assert kernel_call in hlo and hbm_traffic.kernel_calls(hlo) >= build.spec.num_layers
