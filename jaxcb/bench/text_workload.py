"""Workloads of real requests: chat-templated questions and instructions about real text.

The text is the Python reference documentation every CPython ships as `pydoc_data.topics`
(the help() topics: statements, expressions, data model, string methods, ...): real English
prose with some grammar and code, written by the Python documentation's authors (PSF license),
not by this project, and present on any machine with Python, so nothing is downloaded or
stored here. It changes little between CPython releases, but it does change: the workload
records the source's SHA-256, and the documented token totals are checked only when the
digest is the one they were measured on.

Each request is drawn with `random.Random(seed)`, in this order: its kind (a quarter are short
questions about a topic's title: the topic, then the question), else the instruction, the
passage's target length (log-uniform in PASSAGE_TOKENS, so most passages are a few hundred
tokens and a few near 2,000), the topic and first paragraph; then a fixed output length. The
passage is whole paragraphs from that one topic, as many as fit the target (a first paragraph
longer than the target is cut at a word). The user message goes through the model's own chat
template once, here (`apply_chat_template(add_generation_prompt=True)`), so every system is
sent the very same token ids.

Output lengths: natural workloads are greedy to the end of the turn, with a cap; each system
stops at `stop_token_ids`, the end-of-generation tokens llama.cpp derives for the vocabulary
(for SmolLM2: <|endoftext|>, <|im_end|>, <reponame>), passed to every system explicitly.
Fixed workloads ignore EOS and run every request to its own drawn length.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Target passage lengths, in tokens of the model's tokenizer (log-uniform between).
PASSAGE_TOKENS = (48, 1900)
#: Share of requests that are a short question without a passage.
SHORT_QUESTION_SHARE = 0.25
#: Tokens that end a turn for llama.cpp when they are in the vocabulary (its EOG heuristics).
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<reponame>", "<|eot_id|>", "<|end|>", "</s>")

QUESTIONS = (
    "What is {title} in Python? Answer briefly.",
    "Explain {title} to a beginner programmer in a few sentences.",
    "Write a short Python example that shows {title}.",
    "What should I know about {title} in Python?",
)
INSTRUCTIONS = (
    "Summarize the following text in two sentences.\n\n{passage}",
    "Read the passage below and answer: what is its main topic?\n\n{passage}",
    "{passage}\n\nList three key points of the text above.",
    "Explain the following documentation to a beginner programmer.\n\n{passage}",
    "Here is an excerpt from the Python documentation:\n\n{passage}\n\nWrite one question a "
    "student could ask about it, then answer it.",
    "Give the following text a short title.\n\n{passage}",
    "{passage}\n\nWhat does the text above say about {title}?",
)

#: The input-grounded kind ("grounded"): the answer repeats much of the passage (quoting,
#: copying, light edits), where prompt-lookup speculation pays (docs/speculative_decoding.md).
GROUNDED_INSTRUCTIONS = (
    "Copy the following text exactly, word for word.\n\n{passage}",
    "Quote the first paragraph of the following text exactly.\n\n{passage}",
    "Fix any spelling mistakes in the following text and return the whole text.\n\n{passage}",
    "Rewrite the following text with 'Python' replaced by 'the language'; change nothing "
    "else.\n\n{passage}",
    "{passage}\n\nRepeat the text above, one sentence per line.",
)
#: Request kinds: their instructions, and the share of short questions without a passage.
KINDS = {"chat": (INSTRUCTIONS, SHORT_QUESTION_SHARE), "grounded": (GROUNDED_INSTRUCTIONS, 0.0)}


@dataclass(frozen=True)
class Topic:
    title: str  # the heading, e.g. 'The "with" statement'
    paragraphs: list[str]
    tokens: list[int]  # token count of each paragraph


def source_text() -> tuple[dict[str, str], dict[str, Any]]:
    """The help() topics of this Python, and what identifies them (version, SHA-256)."""
    from pydoc_data.topics import topics

    digest = hashlib.sha256()
    for key in sorted(topics):
        digest.update(key.encode() + b"\0" + topics[key].encode() + b"\0")
    info = dict(
        source="pydoc_data.topics",
        python=".".join(map(str, sys.version_info[:3])),
        topics=len(topics),
        characters=sum(len(v) for v in topics.values()),
        sha256=digest.hexdigest(),
    )
    return dict(topics), info


def split_topic(text: str, tokenizer: Any) -> Topic:
    """A topic's title (its first line) and its paragraphs (blank-line separated), counted."""
    lines = text.strip("\n").split("\n")
    title = lines[0].strip()
    body = "\n".join(lines[2:] if len(lines) > 1 and set(lines[1]) <= {"*", "="} else lines[1:])
    paragraphs = [p.strip("\n") for p in body.split("\n\n") if p.strip()]
    counts = [len(ids) for ids in tokenizer(paragraphs, add_special_tokens=False)["input_ids"]]
    return Topic(title, paragraphs, counts)


def take_passage(topic: Topic, target: int, rng: random.Random, tokenizer: Any) -> str:
    """Whole paragraphs of `topic` from a random start, as many as fit `target` tokens (at
    least one, cut at a word if it alone is longer)."""
    total = sum(topic.tokens)
    starts = [
        i for i in range(len(topic.paragraphs)) if sum(topic.tokens[i:]) >= min(target, total)
    ]
    i = rng.choice(starts)
    chosen, used = [topic.paragraphs[i]], topic.tokens[i]
    for paragraph, n in zip(topic.paragraphs[i + 1 :], topic.tokens[i + 1 :], strict=True):
        if used + n > target:
            break
        chosen.append(paragraph)
        used += n
    if used > target:  # a single long paragraph: keep its first `target` tokens' words
        ids = tokenizer(chosen[0], add_special_tokens=False)["input_ids"][:target]
        chosen = [tokenizer.decode(ids).rsplit(" ", 1)[0]]
    return "\n\n".join(chosen)


def stop_token_ids(model_dir: Path, tokenizer: Any) -> tuple[int, ...]:
    """The model's EOS ids (generation_config.json, the tokenizer) and END_TOKENS it has."""
    from jaxcb.models.weights import generation_eos

    ids = generation_eos(Path(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in END_TOKENS if t in vocab}
    return tuple(sorted(ids))


def draw_messages(
    n: int,
    seed: int,
    topics: list[Topic],
    tokenizer: Any,
    output_len: tuple[int, int],
    kind: str = "chat",
) -> list[tuple[str, int]]:
    """n (user message, fixed output length) pairs, drawn as the module docstring says,
    with the instructions of `kind` (KINDS)."""
    instructions, short_share = KINDS[kind]
    rng = random.Random(seed)
    big = sorted(topics, key=lambda t: sum(t.tokens))
    lo, hi = PASSAGE_TOKENS
    out = []
    for _ in range(n):
        if rng.random() < short_share:
            topic = rng.choice(topics)
            title = topic.title[0].lower() + topic.title[1:]  # 'The "with" statement'
            message = rng.choice(QUESTIONS).format(title=title)
        else:
            template = rng.choice(instructions)
            target = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            fits = [t for t in big if sum(t.tokens) >= target] or big[-1:]
            topic = rng.choice(fits)
            passage = take_passage(topic, target, rng, tokenizer)
            message = template.format(passage=passage, title=topic.title)
        out.append((message, rng.randint(*output_len)))
    return out


def build_text_requests(
    model_dir: Path, n: int, seed: int, output_len: tuple[int, int], kind: str = "chat"
) -> tuple[list[list[int]], list[int], tuple[int, ...], dict[str, Any]]:
    """Prompt token ids (chat-templated), fixed output lengths, stop ids and source info for
    the first n requests of `kind` (KINDS), tokenized by `model_dir`'s tokenizer
    (ValueError without a chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{model_dir} has no chat template: the real-text workloads need a chat model's "
            "tokenizer (e.g. --model smollm2-135m)"
        )
    texts, info = source_text()
    topics = [split_topic(texts[k], tokenizer) for k in sorted(texts)]
    messages = draw_messages(n, seed, topics, tokenizer, output_len, kind)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for m, _ in messages
    ]
    digest = hashlib.sha256(repr(prompts).encode()).hexdigest()
    info |= dict(tokenizer=str(model_dir), prompt_ids_sha256=digest)
    return prompts, [k for _, k in messages], stop_token_ids(model_dir, tokenizer), info
