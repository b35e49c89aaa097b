"""Greedy parity with Hugging Face transformers, the definition of correct.

For each supported family: a random-weight model made by transformers, saved, and loaded
through jaxcb's loader; 16 requests with prompts of 1 to 300 tokens run together under a
token budget small enough to force chunked prefill and a page pool small enough to force
preemption. Every request's tokens must equal transformers' generate on that request alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FAMILIES, hf_greedy, make_hf_model, random_prompts

from jaxcb import LLM, SamplingParams

NUM_REQUESTS = 16
ENGINE_KW = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,  # < longest prompt: chunked prefill
    token_buckets=[16, 64],
    max_model_len=512,
    page_size=16,
    num_pages=40,  # 640 tokens for 8 running requests of up to ~340: preemption
)


def run_parity(family: str, tmp_path, **engine_kw):
    model = make_hf_model(family, tmp_path)
    prompts = random_prompts(NUM_REQUESTS, seed=1, max_len=300)
    rng = np.random.default_rng(2)
    max_tokens = [int(m) for m in rng.integers(1, 40, size=NUM_REQUESTS)]
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    distinct = {t for seq in expected for t in seq}
    assert len(distinct) > 50, f"reference output is not diverse ({len(distinct)} tokens)"

    llm = LLM(tmp_path, **{**ENGINE_KW, **engine_kw})
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.token_ids for o in outs]
    mismatched = [i for i in range(NUM_REQUESTS) if got[i] != expected[i]]
    assert not mismatched, (
        f"{family}: requests {mismatched} differ, e.g. "
        f"{got[mismatched[0]]} != {expected[mismatched[0]]}"
    )
    stats = llm.stats()
    assert stats["preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert stats["kv_pages_used"] == 0
    llm.engine.check_page_invariant()
    return llm


#: Families whose forward another default test also checks against transformers
#: (models/test_stacking.py: gemma2, qwen3-moe; e2e/test_lora.py with peft: phi3, gemma3):
#: here with --runslow. The engine's side of this test (chunked prefill, preemption) is the
#: same for every family.
PARITY_ELSEWHERE = {"gemma2", "qwen3-moe", "phi3", "gemma3"}


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.slow if f in PARITY_ELSEWHERE else ())
        for f in sorted(FAMILIES)
    ],
)
def test_greedy_parity_with_transformers(family, tmp_path):
    run_parity(family, tmp_path)


@pytest.mark.parametrize("attention", ["pallas-gpu", "pallas-tpu"])
def test_greedy_parity_with_pallas_kernels_in_interpret_mode(attention, tmp_path):
    """The engine's parity test with each Pallas kernel (interpret mode on CPU): a smaller
    workload, since interpret mode is slow, still with chunked prefill and preemption."""
    model = make_hf_model("qwen3", tmp_path)
    prompts = random_prompts(6, seed=3, max_len=100)
    max_tokens = [6, 3, 8, 5, 7, 4]
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    llm = LLM(
        tmp_path,
        attention=attention,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=[64],
        max_model_len=128,
        page_size=16,
        num_pages=8,
    )
    outs = llm.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens], use_tqdm=False
    )
    assert [o.token_ids for o in outs] == expected
    assert llm.stats()["preemptions"] > 0
    assert llm.engine.info.attention_backend == attention


@pytest.mark.parametrize("attention", ["xla", "native"])
def test_greedy_parity_each_cpu_backend(attention, tmp_path):
    """The default CPU backend is native when a compiler exists; both CPU paths keep parity."""
    if attention == "native":
        from jaxcb.native import available

        if not available():
            pytest.skip("no C++ compiler")
    llm = run_parity("llama3", tmp_path, attention=attention)
    assert llm.engine.info.attention_backend == attention
