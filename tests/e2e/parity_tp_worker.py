"""Runs in its own process with 2 forced CPU devices (the device count is fixed when jax's
backend starts; the rest of the suite runs on one): for each family named on the command
line, a tiny random-weight transformers model, and jaxcb's greedy tokens on it with tensor
parallelism 2 (chunked prefill and preemption forced) next to transformers' own. Prints one
JSON object {family: {"expected": [...], "got": [...], "preemptions": n}}.

    python tests/e2e/parity_tp_worker.py WORK_DIR FAMILY [FAMILY ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 2)  # before any device is touched

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/helpers.py

from helpers import hf_greedy, make_hf_model, random_prompts  # noqa: E402

from jaxcb import LLM, SamplingParams  # noqa: E402

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
        llm = LLM(path, **ENGINE)
        params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS]
        outs = llm.generate(prompts, params, use_tqdm=False)
        report[family] = {
            "expected": expected,
            "got": [o.token_ids for o in outs],
            "preemptions": llm.stats()["preemptions"],
            # the KV pool split by head over both devices: the run was tensor parallel
            "kv_shards": len(llm.engine.runner.state.kv_caches[0].addressable_shards),
        }
        llm.engine.check_page_invariant()
        del llm
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
