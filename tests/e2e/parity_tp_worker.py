"""Runs in its own process with 2 forced CPU devices (the device count is fixed when jax's
backend starts; the rest of the suite runs on one): for each family named on the command
line, a tiny random-weight transformers model, and jaxcb's greedy tokens on it with tensor
parallelism 2 (chunked prefill and preemption forced) next to transformers' own; then two
LoRA adapters and base rows in one run on the tiny llama3 (its slot arrays sharded as their
base weights are) next to peft's tokens. Prints one JSON object {family or "lora":
{"expected": [...], "got": [...], "preemptions": n, "kv_shards": n}}.

    python tests/e2e/parity_tp_worker.py WORK_DIR FAMILY [FAMILY ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 2)  # before any device is touched

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/helpers.py

from helpers import hf_greedy, make_adapter, make_hf_model, random_prompts  # noqa: E402

from jaxcb import LLM, LoRARequest, SamplingParams  # noqa: E402

ENGINE = dict(
    tensor_parallel_size=2,
    max_num_seqs=4,
    max_num_batched_tokens=32,  # < the longest prompt: chunked prefill
    token_buckets=[32],  # one compile per family
    max_model_len=160,
    page_size=8,
    num_pages=24,  # 192 tokens for 4 requests of up to ~130: preemption
)
MAX_TOKENS = [9, 4, 12, 7, 10, 6]


def main(work: Path, families: list[str]) -> None:
    assert len(jax.devices()) == 2, jax.devices()
    report = {}
    for family in families:
        path = work / family
        model = make_hf_model(family, path)
        prompts = random_prompts(len(MAX_TOKENS), seed=5, max_len=120)
        expected = [hf_greedy(model, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
        report[family] = run(LLM(path, **ENGINE), prompts, expected)
    report["lora"] = run_lora(work / "lora")
    print(json.dumps(report))


def run(llm: LLM, prompts: list[list[int]], expected: list[list[int]], **generate) -> dict:
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False, **generate)
    llm.engine.check_page_invariant()
    return {
        "expected": expected,
        "got": [o.token_ids for o in outs],
        "preemptions": llm.stats()["preemptions"],
        # the KV pool split by head over both devices: the run was tensor parallel
        "kv_shards": len(llm.engine.runner.state.kv_caches[0].addressable_shards),
    }


def run_lora(path: Path) -> dict:
    make_hf_model("llama3", path / "base")
    adapters = [
        make_adapter("llama3", path / "base", path / f"a{i}", seed=20 + i, rank=rank)
        for i, rank in enumerate([8, 4])
    ]
    requests = [LoRARequest(f"a{i}", i + 1, str(path / f"a{i}")) for i in range(2)]
    which = [0, None, 1, 1, None, 0]
    prompts = random_prompts(len(MAX_TOKENS), seed=7, max_len=120)
    expected = []
    for prompt, m, w in zip(prompts, MAX_TOKENS, which, strict=True):
        if w is None:
            with adapters[0].disable_adapter():
                expected.append(hf_greedy(adapters[0], prompt, m))
        else:
            expected.append(hf_greedy(adapters[w], prompt, m))
    with adapters[0].disable_adapter():
        base = [hf_greedy(adapters[0], p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    llm = LLM(path / "base", enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    lora_request = [None if w is None else requests[w] for w in which]
    changed = sum(e != b for e, b in zip(expected, base, strict=True))
    return {**run(llm, prompts, expected, lora_request=lora_request), "changed": changed}


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
