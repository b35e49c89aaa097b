"""Benchmark workloads of shared/BENCHMARKS.md, generated exactly and deterministically.

A workload is a list of requests (prompt token ids, max_tokens), all greedy. The random ones
ignore EOS. The real-text ones (`chat-natural`, `chat-fixed`: chat requests about the Python
documentation, built by bench/text_workload.py with the model's own tokenizer and chat
template) either stop at the end of the turn (`stop_token_ids`, max_tokens a cap) or ignore
EOS with drawn lengths; both send the same prompts.

A random workload is drawn with Python's `random` module, per request in this order: prompt
length, its token ids, then max_tokens (shared-prefix first draws its common prefix's ids
once). That order fixes the numbers BENCHMARKS.md quotes (offline-mixed: 16,755 prompt + 9,282
generated tokens), so every script and every machine sees the same requests. `num_requests`
smaller than the default takes the first requests of the full list.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

#: Token ids are drawn from [1, REFERENCE_VOCAB) whatever the model, so the lengths (and the
#: totals above) never depend on the model; a smaller vocabulary folds the ids into its range.
REFERENCE_VOCAB = 32000


@dataclass(frozen=True)
class WorkloadSpec:
    """How to draw a workload: request count and inclusive uniform ranges."""

    name: str
    description: str
    num_requests: int
    prompt_len: tuple[int, int]
    max_tokens: tuple[int, int]
    #: Tokens every prompt starts with (drawn once); prompt_len then counts the own tokens.
    shared_prefix_len: int = 0
    #: (prompt, generated) token totals at the default request count, checked when drawn
    #: (a text workload: only from the text source these were measured on, TEXT_SOURCE_SHA256).
    expected_totals: tuple[int, int] | None = None
    #: "random": uniform token ids; "text": chat requests on real text (bench/text_workload.py)
    source: str = "random"
    #: False: greedy to the end of the turn, max_tokens a cap (natural output lengths)
    ignore_eos: bool = True
    #: A text workload's requests: "chat" (questions and instructions about a passage) or
    #: "grounded" (answers that repeat the passage: bench/text_workload.py's KINDS)
    text_kind: str = "chat"


#: chat-fixed's output lengths; chat-natural draws them too, unused, so the prompts match.
TEXT_FIXED_LEN = (16, 256)

WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec
    for spec in (
        WorkloadSpec(
            "offline-mixed",
            "128 requests, prompts uniform in [16, 256], max_tokens uniform in [16, 128]",
            num_requests=128,
            prompt_len=(16, 256),
            max_tokens=(16, 128),
            expected_totals=(16755, 9282),
        ),
        WorkloadSpec(
            "offline-long",
            "32 requests, prompts uniform in [512, 1536], max_tokens 64 (max_model_len >= 1600)",
            num_requests=32,
            prompt_len=(512, 1536),
            max_tokens=(64, 64),
        ),
        WorkloadSpec(
            "shared-prefix",
            "64 requests: one 512-token system prefix + 16-64 own tokens each, max_tokens 64",
            num_requests=64,
            prompt_len=(16, 64),
            max_tokens=(64, 64),
            shared_prefix_len=512,
        ),
        WorkloadSpec(
            "chat-natural",
            "128 chat requests about Python-doc passages (~30 to ~2,000 tokens), greedy to the "
            "end of the turn, at most 256 tokens",
            num_requests=128,
            prompt_len=(0, 0),  # drawn by bench/text_workload.py
            max_tokens=(256, 256),
            source="text",
            ignore_eos=False,
        ),
        WorkloadSpec(
            "chat-fixed",
            "the chat-natural prompts, EOS ignored, max_tokens uniform in [16, 256]",
            num_requests=128,
            prompt_len=(0, 0),
            max_tokens=TEXT_FIXED_LEN,
            source="text",
        ),
        WorkloadSpec(
            "grounded",
            "64 input-grounded chat requests: copy, quote, correct or rewrite a Python-doc "
            "passage (~50 to ~2,000 tokens), greedy to the end of the turn, at most 256 tokens",
            num_requests=64,
            prompt_len=(0, 0),
            max_tokens=(256, 256),
            source="text",
            ignore_eos=False,
            text_kind="grounded",
        ),
    )
}
#: pydoc_data.topics of CPython 3.11.7, on which the text workloads' totals were measured.
TEXT_SOURCE_SHA256 = ""


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]
    seed: int
    #: greedy stops at these unless ignore_eos (empty for the random workloads)
    stop_token_ids: tuple[int, ...] = ()
    source_info: dict | None = None  # the text source and tokenizer of a text workload

    @property
    def ignore_eos(self) -> bool:
        return self.spec.ignore_eos

    @property
    def stops(self) -> tuple[int, ...]:
        """The tokens greedy stops at: none when EOS is ignored."""
        return () if self.ignore_eos else self.stop_token_ids

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """Output tokens asked for: exact when EOS is ignored, an upper bound otherwise."""
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output: the max_model_len a system needs."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    @property
    def is_complete(self) -> bool:
        return len(self.requests) == self.spec.num_requests and self.seed == 0

    def summary(self) -> dict:
        return dict(
            name=self.name,
            description=self.spec.description,
            seed=self.seed,
            num_requests=len(self.requests),
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            max_seq_len=self.max_seq_len,
            expected_totals=list(self.spec.expected_totals) if self.spec.expected_totals else None,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids),
            source=self.source_info,
        )


def make_workload(
    name: str,
    *,
    num_requests: int | None = None,
    vocab_size: int = REFERENCE_VOCAB,
    seed: int = 0,
    model_dir: Path | None = None,
) -> Workload:
    """Draw workload `name`; the first `num_requests` of it if given. Checks the documented
    totals when the full workload is drawn with seed 0 (ValueError if they differ). A text
    workload needs `model_dir`, whose tokenizer and chat template make its prompts."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    spec = WORKLOADS[name]
    n = spec.num_requests if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if spec.source == "text":
        workload = text_workload(spec, n, seed, model_dir)
    else:
        workload = Workload(spec, random_requests(spec, n, seed, vocab_size), seed)
    if workload.is_complete and spec.expected_totals is not None:
        totals = (workload.prompt_tokens, workload.output_tokens)
        measured_here = spec.source != "text" or (
            workload.source_info["sha256"] == TEXT_SOURCE_SHA256
        )
        if measured_here and totals != spec.expected_totals:
            raise ValueError(
                f"workload {name} drew {totals} (prompt, output) tokens but BENCHMARKS.md says "
                f"{spec.expected_totals}: the generator changed"
            )
    return workload


def text_workload(spec: WorkloadSpec, n: int, seed: int, model_dir: Path | None) -> Workload:
    """A chat workload on real text (bench/text_workload.py), tokenized by `model_dir`."""
    from jaxcb.bench.text_workload import build_text_requests

    if model_dir is None:
        raise ValueError(f"workload {spec.name} needs a model with a chat tokenizer")
    prompts, fixed, stops, info = build_text_requests(
        Path(model_dir), n, seed, TEXT_FIXED_LEN, spec.text_kind
    )
    lengths = fixed if spec.ignore_eos else [spec.max_tokens[1]] * n
    requests = [BenchRequest(p, m) for p, m in zip(prompts, lengths, strict=True)]
    return Workload(spec, requests, seed, stop_token_ids=stops, source_info=info)


def random_requests(spec: WorkloadSpec, n: int, seed: int, vocab_size: int) -> list[BenchRequest]:
    """The first n requests of a random workload, in the draw order the docstring gives."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, REFERENCE_VOCAB) for _ in range(spec.shared_prefix_len)]
    requests = []
    for _ in range(n):
        length = rng.randint(*spec.prompt_len)
        ids = prefix + [rng.randrange(1, REFERENCE_VOCAB) for _ in range(length)]
        if vocab_size < REFERENCE_VOCAB:
            ids = [1 + (t - 1) % (vocab_size - 1) for t in ids]
        lo, hi = spec.max_tokens
        max_tokens = lo if lo == hi else rng.randint(lo, hi)  # a fixed value draws nothing
        requests.append(BenchRequest(ids, max_tokens))
    return requests


def single_request(workload: Workload, max_tokens: int) -> Workload:
    """One request alone, for single-stream figures: the workload's first with a short prompt
    (<= 64 tokens; else its shortest), `max_tokens` tokens with EOS ignored."""
    short = [r for r in workload.requests if len(r.prompt_token_ids) <= 64]
    prompt = (short or sorted(workload.requests, key=lambda r: len(r.prompt_token_ids)))[0]
    request = BenchRequest(list(prompt.prompt_token_ids), max_tokens)
    return replace(workload, spec=replace(workload.spec, ignore_eos=True), requests=[request])
