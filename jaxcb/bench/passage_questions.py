"""A shared-prefix workload for offline ordering (`python -m jaxcb.bench scheduling order`):
several questions about each of N passages, shuffled.

Each request is one user message, the passage first and its question after it, through the
model's chat template, so every question about a passage shares the template's header and
the whole passage as a prompt prefix. Passages are real text (bench/text_workload.py's
source, the Python reference documentation every CPython ships), their target lengths
log-uniform in `passage_tokens`; `source="random"` draws passages and questions as random
token ids instead, for a model without a chat template (the tests' tiny model).

Drawn with `random.Random(seed)`: per passage its topic, length and paragraphs, then its
questions (distinct templates), then every request's output length, then the shuffle. Greedy,
EOS ignored: every request runs to its drawn length, so each order generates the very same
tokens and the throughputs compare.
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

from jaxcb.bench.workloads import REFERENCE_VOCAB, BenchRequest, Workload, WorkloadSpec

QUESTIONS = (
    "Summarize the text above in two sentences.",
    "What is the main topic of the text above?",
    "List three key points of the text above.",
    "Explain the text above to a beginner programmer.",
    "Write one question a student could ask about the text above, then answer it.",
    "Give the text above a short title.",
    "Which Python keywords or names does the text above mention?",
    "Write a short Python example that illustrates the text above.",
)
SOURCES = ("text", "random")


def passage_questions(
    model_dir: Path,
    *,
    num_passages: int,
    num_questions: int,
    seed: int = 0,
    output_len: tuple[int, int] = (16, 256),
    passage_tokens: tuple[int, int] = (256, 1200),
    source: str = "text",
    vocab_size: int = REFERENCE_VOCAB,
) -> Workload:
    """num_passages x num_questions requests, shuffled (module docstring). ValueError for
    bad sizes, or a text source without a chat template."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}")
    if num_passages < 1 or not 1 <= num_questions <= len(QUESTIONS):
        raise ValueError(
            f"need num_passages >= 1 and num_questions in [1, {len(QUESTIONS)}], got "
            f"{num_passages} and {num_questions}"
        )
    lo, hi = passage_tokens
    if not 1 <= lo <= hi or not 1 <= output_len[0] <= output_len[1]:
        raise ValueError(f"bad ranges: passage_tokens={passage_tokens}, output_len={output_len}")
    rng = random.Random(seed)
    if source == "text":
        prompts, info = _text_prompts(model_dir, rng, num_passages, num_questions, lo, hi)
    else:
        prompts, info = _random_prompts(rng, num_passages, num_questions, lo, hi, vocab_size)
    lengths = [rng.randint(*output_len) for _ in prompts]
    requests = [BenchRequest(p, m) for p, m in zip(prompts, lengths, strict=True)]
    rng.shuffle(requests)
    spec = WorkloadSpec(
        "passage-questions",
        f"{num_passages} passages x {num_questions} questions ({source}), shuffled; passages "
        f"of {lo}-{hi} tokens, max_tokens uniform in {list(output_len)}, EOS ignored",
        num_requests=len(requests),
        prompt_len=(0, 0),
        max_tokens=output_len,
        source=source,
    )
    digest = hashlib.sha256(repr([r.prompt_token_ids for r in requests]).encode()).hexdigest()
    return Workload(spec, requests, seed, source_info={**info, "prompt_ids_sha256": digest})


def _text_prompts(
    model_dir: Path, rng: random.Random, num_passages: int, num_questions: int, lo: int, hi: int
) -> tuple[list[list[int]], dict]:
    from transformers import AutoTokenizer

    from jaxcb.bench.text_workload import source_text, split_topic, take_passage

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{model_dir} has no chat template: the text source needs a chat model's tokenizer "
            "(e.g. --model smollm2-135m), or use --source random"
        )
    texts, info = source_text()
    topics = [split_topic(texts[k], tokenizer) for k in sorted(texts)]
    big = sorted(topics, key=lambda t: sum(t.tokens))
    prompts = []
    for _ in range(num_passages):
        target = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        topic = rng.choice([t for t in big if sum(t.tokens) >= target] or big[-1:])
        passage = take_passage(topic, target, rng, tokenizer)
        for question in rng.sample(QUESTIONS, num_questions):
            message = [{"role": "user", "content": f"{passage}\n\n{question}"}]
            ids = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
            prompts.append(list(ids))
    return prompts, {**info, "tokenizer": str(model_dir)}


def _random_prompts(
    rng: random.Random,
    num_passages: int,
    num_questions: int,
    lo: int,
    hi: int,
    vocab_size: int,
) -> tuple[list[list[int]], dict]:
    def ids(n: int) -> list[int]:
        return [1 + rng.randrange(REFERENCE_VOCAB - 1) % (vocab_size - 1) for _ in range(n)]

    prompts = []
    for _ in range(num_passages):
        passage = ids(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        prompts += [passage + ids(rng.randint(8, 24)) for _ in range(num_questions)]
    return prompts, {"source": "random token ids"}
