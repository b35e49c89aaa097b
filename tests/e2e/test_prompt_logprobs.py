"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' float32 log-softmax on
the same weights, whatever the engine does to the prompt: one step, chunked prefill, a
cached prefix, preemption; with top-k entries; without a new trace of the step function.

One engine (a token budget of 32: longer prompts are chunked; 40 pages of 8 tokens: several
long requests preempt each other), a tiny random Llama 3 with its own LM head (packed for
the native matmul where the CPU has one) and one with tied embeddings.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_hf_model, traced_programs
from test_prefix_caching import run_checked

from jaxcb import LLM, SamplingParams
from jaxcb.runtime import step as step_module

CONFIG = dict(
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[16, 32],
    max_model_len=256,
    page_size=8,
    num_pages=40,
    dtype="float32",
)
ATOL = 1e-4  # float32: the two sides sum in different orders


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    return make_hf_model("llama3", path), path


@pytest.fixture(scope="module")
def llm(hf_model):
    traces = step_module.TRACE_COUNT[0]
    engine = LLM(hf_model[1], **CONFIG)
    # one trace (and one compiled program) per bucket, the prompt logprob path included,
    # and one sampling program per sequence-row count
    assert step_module.TRACE_COUNT[0] - traces == traced_programs(engine.engine.info.buckets)
    return engine


def reference(model, prompt: list[int]) -> np.ndarray:
    """f32[P - 1, V]: transformers' log-softmax at positions 0 .. P - 2 (row p predicts
    prompt token p + 1)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()[:-1]


def check(out, model, prompt: list[int], k: int) -> None:
    """Every entry: the prompt token's logprob, then exactly the reference's top k."""
    ref = reference(model, prompt)
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    got = np.array([entries[i][prompt[i]] for i in range(1, len(prompt))])
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    for i, entry in enumerate(entries[1:]):
        assert next(iter(entry)) == prompt[i + 1]  # the prompt token first
        top = np.argsort(-ref[i], kind="stable")[:k]
        assert set(entry) == {prompt[i + 1], *top.tolist()}
        np.testing.assert_allclose([entry[t] for t in top], ref[i, top], atol=ATOL, rtol=0)


def prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(m)).tolist() for m in rng.integers(low, high, size=n)]


def run(llm: LLM, prompts, params, *, record: bool = False):
    """run_checked (the page invariant after every step), and the steps' records."""
    llm.engine.record_steps(record)
    outs = run_checked(llm, prompts, params)
    records = llm.engine.pop_step_records()
    llm.engine.record_steps(False)
    return (outs, records) if record else outs


def test_one_step_and_chunked_prefill(llm, hf_model):
    model = hf_model[0]
    short, long = prompts(1, seed=0, low=20, high=30)[0], prompts(1, seed=1, low=150, high=160)[0]
    sp = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0)
    outs, records = run(llm, [short, long], [sp, sp], record=True)
    chunks = [c for r in records for c in r.chunks if c[2] == "prefill"]
    assert sum(c[1] for c in chunks) == len(short) + len(long)
    assert len(chunks) >= 1 + len(long) // CONFIG["max_num_batched_tokens"]  # chunked
    for out, prompt in zip(outs, [short, long], strict=True):
        check(out, model, prompt, k=0)
        assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    alone = llm.generate([long], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert alone.prompt_logprobs is None
    assert alone.token_ids == outs[1].token_ids  # scoring the prompt changes no token


def test_top_k_and_n(llm, hf_model):
    """Top-5 entries; with n=2 the prompt is scored once and both samples share it."""
    prompt = prompts(1, seed=2, low=40, high=50)[0]
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, prompt_logprobs=5)
    (out,) = run(llm, [prompt], [sp])
    assert len(out.outputs) == 2
    check(out, hf_model[0], prompt, k=5)
    assert {len(e) for e in out.prompt_logprobs[1:]} <= {5, 6}


def test_cached_prefix_is_recomputed_and_shared(llm, hf_model):
    """A request with prompt logprobs takes no cached page (it must score those positions)
    but registers its pages for the requests after it."""
    llm.reset_prefix_cache()
    prefix = prompts(1, seed=4, low=48, high=49)[0]  # 6 full pages
    a = [*prefix, 7, 8, 9]
    b = prefix + prompts(1, seed=5, low=20, high=21)[0]  # 68 tokens: 8 full pages
    greedy = SamplingParams(max_tokens=2, temperature=0)
    first = run(llm, [a], [greedy])[0]
    assert first.num_cached_tokens == 0
    (scored,) = run(llm, [b], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)])
    assert scored.num_cached_tokens == 0  # the prefix was cached, and not taken
    check(scored, hf_model[0], b, k=1)
    (again,) = run(llm, [b], [greedy])
    assert again.num_cached_tokens == 64  # b's own pages: registered by the scored request
    assert again.token_ids == scored.token_ids


def test_preemption_loses_and_duplicates_nothing(llm, hf_model):
    """Six requests of up to ~190 tokens in 320 tokens of pages: preempted mid-prefill and
    while decoding, recomputed (from the prefix cache where allowed)."""
    llm.reset_prefix_cache()
    ps = prompts(6, seed=6, low=60, high=150)
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=i % 3)
        for i in range(6)
    ]
    before = llm.stats()["preemptions"]
    outs = run(llm, ps, params)
    assert llm.stats()["preemptions"] > before, "the pool was meant to be small enough"
    for i, (out, prompt) in enumerate(zip(outs, ps, strict=True)):
        check(out, hf_model[0], prompt, k=i % 3)


def test_no_new_trace_and_validation(llm):
    traces = step_module.TRACE_COUNT[0]
    ps = prompts(5, seed=7, low=1, high=70)
    params = [
        SamplingParams(max_tokens=5, temperature=t, logprobs=lp, prompt_logprobs=plp)
        for t, lp, plp in [(0, None, None), (0.8, 2, 0), (0, None, 20), (0, 1, None), (0.5, 0, 3)]
    ]
    outs = run(llm, ps, params)
    assert outs[0].prompt_logprobs is None and outs[3].prompt_logprobs is None
    assert len(outs[2].prompt_logprobs) == len(ps[2])
    assert step_module.TRACE_COUNT[0] == traces, "the step function was traced again"

    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs must be <= 20"):
        llm.engine.add_request(None, [5, 6], SamplingParams(prompt_logprobs=21))
    assert not llm.engine.has_unfinished_requests()


def test_tied_embeddings(tmp_path):
    """The output head is the embedding table (no lm_head parameter)."""
    model = make_hf_model("llama2-tied", tmp_path)
    tied = LLM(tmp_path, **{**CONFIG, "token_buckets": [32]})
    prompt = prompts(1, seed=8, low=70, high=71)[0]
    (out,) = tied.generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )
    check(out, model, prompt, k=2)
