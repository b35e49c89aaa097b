"""Shared test helpers: tiny random-weight Hugging Face models and their greedy references."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

#: generate.py flags for the tiny model with one bucket to compile (one prompt, 2 tokens).
ONE_BUCKET_GENERATE = [
    *("--model", "jaxcb-tiny-random-llama-v1", "--max-tokens", "2", "--max-model-len", "64"),
    *("--num-pages", "8", "--max-num-seqs", "2", "--max-num-batched-tokens", "16"),
    *("--token-buckets", "16", "--seq-buckets", "2", "--no-enable-prefix-caching"),
]


def run_script(name: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """scripts/NAME.py ARGS in a process of its own (text output captured)."""
    return subprocess.run(
        [sys.executable, f"scripts/{name}.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


#: The built-in tiny random-weight Llama (jaxcb.models.loading.default_model), what most tests run.
TINY_MODEL = "jaxcb-tiny-random-llama-v1"

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,  # 0.02 makes greedy output repeat one token: a parity test of nothing
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_factors = np.random.default_rng(0).uniform(1.0, 8.0, size=(2, 8)).round(3)  # head_dim 16
PHI3_LONGROPE = {
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": (_factors[0] / 4 + 0.75).tolist(),  # in [1, 2.75]
        "long_factor": _factors[1].tolist(),
    },
    "original_max_position_embeddings": 1024,
    "max_position_embeddings": 4096,  # attention factor sqrt(1 + ln 4 / ln 1024)
}

FAMILIES = {
    # name: (transformers config class name, extra config)
    "llama3": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama2-tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "mistral": ("MistralConfig", {"sliding_window": 48}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    # Phi3Config's default pad id (32000) is outside the tiny vocabulary
    "phi3": ("Phi3Config", {"pad_token_id": 0, "sliding_window": 48}),
    # sequences stay under original_max_position_embeddings, where jaxcb's per-token choice
    # of LongRoPE factors and transformers' per-call one agree (models/phi3.py)
    "phi3-longrope": ("Phi3Config", {"pad_token_id": 0, **PHI3_LONGROPE}),
    # Soft caps low enough to bite, windows the prompts exceed. Untied: with Gemma's
    # sqrt(hidden) embedding scale a tiny random tied model repeats its last prompt token.
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 32,
            "sliding_window": 48,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
            "num_hidden_layers": 3,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "sliding_window": 40,
            "num_hidden_layers": 3,
            "sliding_window_pattern": 2,
            "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    # Mixtures of experts (models/moe.py): a few experts, so some get no tokens in a step
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "intermediate_size": 64}),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {"num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    ),
    # top-3 (the sum over k in transformers' order), renormalised; layer 0 a dense MLP
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
}


def traced_programs(buckets) -> int:
    """Programs an engine traces at start-up (runtime/step.py): a step per bucket and a
    sampling program per sequence-row count."""
    return len(buckets) + len({b.num_seqs for b in buckets})


def make_hf_model(family: str, path: Path, *, seed: int = 0, dtype: str = "float32", **overrides):
    """Create a random-weight model with transformers, save it to `path`, return the model."""
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return model


#: What make_adapter's adapters target by default, per family: Phi-3's fused modules; a
#: mixture of experts' attention (its experts are not adapted); every module otherwise.
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "phi3-longrope": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2-moe": ["q_proj", "v_proj", "o_proj"],
    "qwen3-moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def make_adapter(family, base, out_dir, *, seed, rank, targets=None, std=0.3, **config):
    """A random-weight PEFT adapter (entries of standard deviation `std`) for `base` (the
    directory a transformers model is saved in, or the model itself, left untouched), saved
    to out_dir; the peft model (base + adapter) is returned for reference outputs."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if isinstance(base, (str, Path)):
        base = AutoModelForCausalLM.from_pretrained(base).eval()
    else:
        base = copy.deepcopy(base)  # peft puts its layers into the model it is given
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets or TARGETS.get(family, ALL_MODULES),
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(base, cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return model.eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of transformers' generate for one request alone (stops at EOS)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(n: int, *, seed: int, max_len: int, vocab: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=n)
    lengths[0], lengths[1] = 1, max_len  # the extremes always appear
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]


def fake_engine_info(config, *, max_model_len: int, token_buckets: tuple[int, ...]):
    """The EngineInfo of a host-side test's fake device (no model, no jax): `config`'s pages
    and sampling rows, buckets of these token counts."""
    from jaxcb.engine.buckets import make_buckets
    from jaxcb.engine.interface import EngineInfo

    return EngineInfo(
        model_path="fake",
        model_name="fake",
        model_format="safetensors",
        random_weights=True,
        architecture="LlamaForCausalLM",
        vocab_size=100,
        max_model_len=max_model_len,
        buckets=make_buckets(token_buckets, config.max_num_sample_rows),
        page_size=config.cache.page_size,
        num_pages=config.cache.num_pages,
        kv_cache_bytes=0,
        kv_cache_dtype="float32",
        attention_backend="xla",
        matmul_backend="xla",
        platform="cpu",
        load_seconds=0.0,
        compile_seconds=0.0,
    )


class FakeRunnerBase:
    """What a host-side test's fake device does not need to do (engine.interface.Runner's
    health, background compile and close); a subclass runs the steps."""

    def prepare(self, sched, bucket):
        return sched

    def check_health(self) -> None:
        pass

    def background_compile(self) -> tuple[int, float]:
        return 0, 0.0

    def close(self) -> None:
        pass


def isa_level_params(levels, *marks) -> list:
    """This CPU's ISA levels (native.supported_levels()) as pytest params: the active one and
    "avx2" (the AVX2 matmuls' own library, loaded on every CPU that has AVX2) run by default;
    the others with --runslow. Each is a library build of its own (10-16 s on 2 cores) of the
    same kernels at another vector width, or the scalar fallback no AVX2 CPU runs."""
    import pytest

    from jaxcb import native

    default = {native.active_level(), "avx2"}
    return [
        pytest.param(level, marks=[*marks, *(() if level in default else (pytest.mark.slow,))])
        for level in levels
    ]
