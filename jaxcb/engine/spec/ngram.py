"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence
of the request's last n tokens, for n from `max_n` down to `min_n` (the longest match
first). No model: it pays where the output repeats its input (editing, quoting, extracting,
code changes) and costs nearly nothing where it does not.

Each request keeps an index of its n-grams (`NgramIndex`): every n-gram that has a token
after it, mapped to where its latest occurrence ends. It grows by the new tokens each step,
so a proposal costs a few dict look-ups whatever the sequence's length.
"""

from __future__ import annotations

from jaxcb.engine.request import Request
from jaxcb.engine.spec.proposer import Proposer


class NgramIndex:
    """A token list's n-grams (min_n..max_n long) that something follows, each mapped to
    the position after its latest such occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.after: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams ending at each position up to the second last (the last has
        nothing after it yet)."""
        for end in range(self.num_indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.after[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], max_tokens: int) -> list[int]:
        """What followed the longest suffix of `tokens` seen before, at most max_tokens."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + max_tokens]
        return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        index = request.proposer_state
        if index is None:
            index = request.proposer_state = NgramIndex(self.min_n, self.max_n)
        index.update(request.token_ids)
        return index.lookup(request.token_ids, max_tokens)
