"""Benchmark workloads of shared/BENCHMARKS.md, generated exactly and deterministically.

A workload is a list of requests (prompt token ids, max_tokens), all greedy with EOS ignored.
It is drawn with Python's `random` module, per request in this order: prompt length, its token
ids, then max_tokens (shared-prefix first draws its common prefix's ids once). That order fixes
the numbers BENCHMARKS.md quotes (offline-mixed: 16,755 prompt + 9,282 generated tokens), so
every script and every machine sees the same requests. `num_requests` smaller than the
default takes the first requests of the full list.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
    #: (prompt, generated) token totals at the default request count, checked when drawn.
    expected_totals: tuple[int, int] | None = None


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
    )
}


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]
    seed: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
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
        )


def make_workload(
    name: str, *, num_requests: int | None = None, vocab_size: int = REFERENCE_VOCAB, seed: int = 0
) -> Workload:
    """Draw workload `name`; the first `num_requests` of it if given. Checks the documented
    totals when the full workload is drawn with seed 0 (ValueError if they differ)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    spec = WORKLOADS[name]
    n = spec.num_requests if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
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
    workload = Workload(spec, requests, seed)
    if workload.is_complete and spec.expected_totals is not None:
        totals = (workload.prompt_tokens, workload.output_tokens)
        if totals != spec.expected_totals:
            raise ValueError(
                f"workload {name} drew {totals} (prompt, output) tokens but BENCHMARKS.md says "
                f"{spec.expected_totals}: the generator changed"
            )
    return workload
