"""Host-side allocator of KV pages: a free list with reference counts.

The device holds `num_pages` pages per layer; this class only decides who owns which.
Invariant (checked by `check_invariant` in tests after every step): every page is either
free or owned, never both, owned pages' ref counts equal their number of owners, and
free + owned == total.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """Asked for more pages than are free (callers check `num_free` first)."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._ref_counts[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._ref_counts[p] <= 0:
                raise RuntimeError(f"page {p} freed but not owned")
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                self._free.append(p)

    def check_invariant(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise AssertionError-like RuntimeError if the page accounting is broken.

        `owners`: the page lists of every request that holds pages.
        """
        owned = Counter(p for pages in owners for p in pages)
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a page is on the free list twice")
        both = free & set(owned)
        if both:
            raise RuntimeError(f"pages both free and owned: {sorted(both)[:10]}")
        for p in range(self.num_pages):
            if self._ref_counts[p] != owned.get(p, 0):
                raise RuntimeError(
                    f"page {p}: ref count {self._ref_counts[p]} but {owned.get(p, 0)} owners"
                )
        if len(free) + len(owned) != self.num_pages:
            raise RuntimeError(
                f"free ({len(free)}) + owned ({len(owned)}) != total ({self.num_pages})"
            )
