"""LoRA adapters end to end: greedy output with an adapter equals transformers + peft on the
same base and adapter, for every family (random-weight adapters on the tiny random models);
a batch mixing adapters and base rows gives each row its own tokens, with more adapters
than slots (requests wait for a slot, slots are swapped) and a pool small enough to
preempt; the prefix cache never shares pages between adapters; nothing is compiled after
warm-up; an adapter that does not fit is one clear error that changes nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import FAMILIES, hf_greedy, make_adapter, make_hf_model, random_prompts

from jaxcb import LLM, LoRARequest, SamplingParams
from jaxcb.runtime import step as step_module

#: one family per forward (llama, Phi-3's fused checkpoint, Gemma, a mixture of experts) by
#: default; the rest with --runslow
DEFAULT_FAMILIES = {"llama3", "phi3", "gemma3", "qwen3-moe"}
#: The 128-token bucket is one where a step without adapter rows takes the fused SwiGLU kernel
#: (models/sublayers.py, FUSED_WITHOUT_ADAPTERS_ROWS): prefills alone and mixed take both ways.
ENGINE_KW = dict(
    max_num_seqs=6,
    max_num_batched_tokens=128,
    token_buckets=[16, 128],
    max_model_len=256,
    page_size=16,
)
MAX_TOKENS = 10


def family_params(families):
    return [
        pytest.param(f, marks=() if f in DEFAULT_FAMILIES else pytest.mark.slow)
        for f in sorted(families)
    ]


@pytest.mark.parametrize("family", family_params(FAMILIES))
def test_adapters_match_peft_in_one_mixed_batch(family, tmp_path):
    """Two adapters (ranks 8 and 4; the second with rsLoRA) and base rows in the same steps:
    every request's greedy tokens are peft's for its adapter, transformers' for the base."""
    make_hf_model(family, tmp_path / "base")
    first = make_adapter(family, tmp_path / "base", tmp_path / "a", seed=1, rank=8)
    second = make_adapter(
        family, tmp_path / "base", tmp_path / "b", seed=2, rank=4, use_rslora=True
    )
    prompts = random_prompts(6, seed=3, max_len=40)
    loras = [LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))]
    which = [0, 1, None, 1, 0, None]
    expected = []
    for prompt, w in zip(prompts, which, strict=True):
        if w is None:
            with first.disable_adapter():
                expected.append(hf_greedy(first, prompt, MAX_TOKENS))
        else:
            expected.append(hf_greedy((first, second)[w], prompt, MAX_TOKENS))
    with first.disable_adapter():
        base_tokens = [hf_greedy(first, p, MAX_TOKENS) for p in prompts]
    changed = sum(e != b for e, b in zip(expected, base_tokens, strict=True))
    assert changed >= 3, "the adapters were meant to change the output"

    llm = LLM(tmp_path / "base", enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE_KW)
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        lora_request=[None if w is None else loras[w] for w in which],
        use_tqdm=False,
    )
    got = [o.outputs[0].token_ids for o in outs]
    wrong = [i for i in range(len(prompts)) if got[i] != expected[i]]
    assert not wrong, f"{family}: requests {wrong} differ: {got[wrong[0]]} != {expected[wrong[0]]}"
    llm.engine.check_page_invariant()


def test_rank_64_adapter_matches_peft(tmp_path):
    make_hf_model("qwen2", tmp_path / "base")
    model = make_adapter("qwen2", tmp_path / "base", tmp_path / "a", seed=5, rank=64)
    prompts = random_prompts(3, seed=6, max_len=30)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(tmp_path / "base", enable_lora=True, max_lora_rank=64, **ENGINE_KW)
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        lora_request=LoRARequest("a", 1, str(tmp_path / "a")),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def four_adapters(tmp_path_factory):
    """The tiny llama3 model and four adapters of it (all modules, ranks 4 to 16)."""
    root = tmp_path_factory.mktemp("lora4")
    make_hf_model("llama3", root / "base")
    loras = []
    for i, rank in enumerate([4, 8, 16, 8]):
        make_adapter("llama3", root / "base", root / f"a{i}", seed=10 + i, rank=rank)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return root / "base", loras


def test_mixed_batch_equals_each_request_alone(four_adapters):
    """16 requests over 4 adapters and the base model, 2 slots, a pool small enough to
    preempt, seeded sampling and greedy: each request's tokens equal its run alone; slots
    were swapped, every pin and page comes back, nothing is traced after warm-up."""
    base, loras = four_adapters
    kw = {**ENGINE_KW, "max_model_len": 96, "num_pages": 8}  # 6 requests in 8 pages: preempts
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, **kw)
    prompts = random_prompts(16, seed=7, max_len=60)
    which = [None if i % 5 == 4 else loras[i % 5] for i in range(16)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0)
        if i % 2
        else SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i)
        for i in range(16)
    ]
    alone = [
        llm.generate(p, sp, lora_request=w, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp, w in zip(prompts, params, which, strict=True)
    ]
    traces = step_module.TRACE_COUNT[0]
    outs = llm.generate(prompts, params, lora_request=which, use_tqdm=False)
    assert step_module.TRACE_COUNT[0] == traces, "loading adapters compiled a step"
    together = [o.outputs[0].token_ids for o in outs]
    wrong = [i for i in range(16) if together[i] != alone[i]]
    assert not wrong, f"requests {wrong} differ from their runs alone"
    stats = llm.stats()
    assert stats["preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert stats["lora_loads"] > 4, "4 adapters in 2 slots: they were meant to be swapped"
    assert stats["kv_pages_used"] == 0
    assert llm.engine.scheduler.lora_slots.num_pinned == 0
    llm.engine.check_page_invariant()


def test_prefix_cache_keeps_adapters_apart(four_adapters):
    """The same prompt under two adapters and the base model: each gets its own tokens (no
    page is shared across adapters); the same adapter again hits the cache."""
    base, loras = four_adapters
    llm = LLM(base, enable_lora=True, max_loras=2, enable_prefix_caching=True, **ENGINE_KW)
    prompt = random_prompts(2, seed=8, max_len=50)[1] + [5] * 30  # 80 tokens
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    fresh = LLM(base, enable_lora=True, max_loras=2, **ENGINE_KW)
    for lora in [loras[0], loras[1], None, loras[0]]:
        got = llm.generate(prompt, sp, lora_request=lora, use_tqdm=False)[0].outputs[0]
        want = fresh.generate(prompt, sp, lora_request=lora, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids, lora
    stats = llm.stats()
    # only the repeated adapter's prompt found its pages (4 full pages of 16)
    assert stats["prefix_hits"] == 64, stats


def test_bad_adapters_are_one_line_errors_that_change_nothing(four_adapters, tmp_path):
    base, loras = four_adapters
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE_KW)
    sp = SamplingParams(max_tokens=4)

    def error(lora) -> str:
        with pytest.raises(ValueError) as info:
            llm.generate([[5, 6, 7], [8, 9]], sp, lora_request=lora, use_tqdm=False)
        message = str(info.value)
        assert "\n" not in message
        return message

    assert "above max_lora_rank=8" in error(loras[2])  # rank 16
    assert "no adapter_config.json" in error(LoRARequest("x", 9, str(tmp_path / "nothing")))
    other = tmp_path / "other"  # an adapter of a model with another hidden size
    make_hf_model("llama3", other / "base", hidden_size=32)
    make_adapter("llama3", other / "base", other / "a", seed=1, rank=4)
    assert "another base model" in error(LoRARequest("o", 10, str(other / "a")))
    unknown = tmp_path / "unknown"
    make_adapter("llama3", base, unknown, seed=1, rank=4, targets=["q_proj", "embed_tokens"])
    assert "embedding" in error(LoRARequest("u", 11, str(unknown)))
    dora = tmp_path / "dora"
    make_adapter("llama3", base, dora, seed=1, rank=4, use_dora=True)
    assert "DoRA" in error(LoRARequest("d", 12, str(dora)))
    config = json.loads((dora / "adapter_config.json").read_text())
    assert config["use_dora"]
    assert llm.engine.num_waiting == 0 and llm.engine.list_loras() == []
    # the same id under another name is refused; the engine still serves
    llm.generate([5, 6], sp, lora_request=loras[0], use_tqdm=False)
    assert "already adapter" in error(LoRARequest("renamed", 1, loras[0].lora_path))
    assert len(llm.generate([5, 6], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4
    plain = LLM(base, **ENGINE_KW)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([5, 6], sp, lora_request=loras[0], use_tqdm=False)


def test_unloading_frees_the_slot(four_adapters):
    base, loras = four_adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, **ENGINE_KW)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    first = llm.generate([7, 8, 9], sp, lora_request=loras[1], use_tqdm=False)[0]
    assert llm.engine.remove_lora(2) == loras[1]
    assert llm.engine.list_loras() == []
    with pytest.raises(ValueError, match="no LoRA adapter"):
        llm.engine.remove_lora(2)
    again = llm.generate([7, 8, 9], sp, lora_request=loras[1], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert np.array_equal(llm.engine.scheduler.lora_slots.loaded, [2])


def test_speculative_decoding_keeps_each_adapters_tokens(four_adapters):
    """A draft model (the base as int8) proposes without the adapters; the target verifies
    with each row's adapter: the tokens are those without speculation."""
    speculative = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 2}
    base, loras = four_adapters
    prompts = random_prompts(6, seed=9, max_len=40)
    which = [loras[0], loras[1], None, loras[2], loras[0], None]
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    kw = dict(enable_lora=True, max_loras=4, max_lora_rank=16, **ENGINE_KW)
    plain = LLM(base, **kw).generate(prompts, sp, lora_request=which, use_tqdm=False)
    llm = LLM(base, speculative_config=speculative, **kw)
    outs = llm.generate(prompts, sp, lora_request=which, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec_decode_counts().num_drafts > 0
