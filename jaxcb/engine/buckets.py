"""Token-budget buckets: the few batch shapes the step function is compiled for."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    num_tokens: int  # T: token rows in the packed batch
    num_seqs: int  # S: sequence rows (page tables, sampling rows)


def default_token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to, and ending at, max_num_batched_tokens."""
    if max_num_batched_tokens < 1 or smallest < 1:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) and smallest ({smallest}) "
            "must be >= 1"
        )
    buckets = []
    b = min(smallest, max_num_batched_tokens)
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return tuple(buckets)


def make_buckets(
    token_buckets: tuple[int, ...], max_num_seqs: int, seq_buckets: tuple[int, ...] = ()
) -> tuple[Bucket, ...]:
    """A bucket of T tokens holds at most min(T, max_num_seqs) sequences; `seq_buckets` adds
    buckets of T tokens with fewer sequence rows (min(s, T) for each s). Sorted by (T, S)."""
    # pick_bucket bisects, so the sizes must be sorted; a shuffled set would pick a bigger
    # bucket than needed.
    if not token_buckets or any(b < 1 for b in token_buckets):
        raise ValueError(f"token buckets must be non-empty and >= 1, got {list(token_buckets)}")
    if list(token_buckets) != sorted(set(token_buckets)):
        raise ValueError(f"token buckets must be strictly increasing, got {list(token_buckets)}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if any(s < 1 for s in seq_buckets):
        raise ValueError(f"sequence buckets must be >= 1, got {list(seq_buckets)}")
    seq_sizes = {min(s, max_num_seqs) for s in seq_buckets} | {max_num_seqs}
    return tuple(
        Bucket(t, s) for t in token_buckets for s in sorted({min(x, t) for x in seq_sizes})
    )


def pick_bucket(buckets: tuple[Bucket, ...], num_tokens: int, num_seqs: int) -> Bucket:
    """The smallest bucket that holds the batch: fewest tokens, then fewest sequences."""
    i = bisect.bisect_left([b.num_tokens for b in buckets], num_tokens)
    while i < len(buckets) and buckets[i].num_seqs < num_seqs:
        i += 1
    if i == len(buckets):
        raise ValueError(
            f"batch of {num_tokens} tokens / {num_seqs} sequences fits no bucket {buckets}"
        )
    return buckets[i]
