"""Host-side allocator of KV pages: a free list, reference counts, and the prefix cache.

The device holds `num_pages` pages per layer; this class only decides who owns which.

Prefix caching: a *full* page whose K/V have been computed can be registered under a hash
of its contents (`register`). A hash chains the parent page's hash with the page's own token
ids (`hash_page`), so it names the whole prefix up to the page's end, not just its tokens:
equal hashes mean equal K/V. A new request looks its pages' hashes up (`lookup`) and shares
the pages it finds (`acquire`: the ref count goes up, nothing is copied). When a hashed page's
ref count drops to zero it is not freed but kept, *evictable*, in LRU order; `allocate` takes
truly free pages first and evicts the least recently released cached pages only when it must.

Every page is exactly one of:
  free       ref count 0, no hash, on the free list
  owned      ref count >= 1 (one per request holding it), with or without a hash
  evictable  ref count 0, hashed, in the LRU
`check_invariant` verifies that (and that ref counts equal the owners given) after every step
in tests. `num_free` counts free + evictable pages: both can be handed out.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence


class OutOfPagesError(RuntimeError):
    """Asked for more pages than are free (callers check `num_free` first)."""


def hash_page(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The chained hash of a full page: SHA-256 over the parent page's hash and the page's
    token ids (8 bytes each, little-endian).

    Why SHA-256 rather than Python's `hash((parent, *tokens))`: int-tuple hashing is
    deterministic, but it is a 64-bit non-cryptographic hash whose collisions are easy to
    construct (an int hashes to itself modulo 2**61 - 1). A collision here would hand one
    prompt another prompt's K/V — wrong output, and a leak between users of a server. A
    cryptographic digest makes that practically impossible, at about a microsecond per page.
    """
    h = hashlib.sha256(parent or b"")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._hash_to_page: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.peak_used = 0
        self.num_evictions = 0

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages owned by at least one request."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (owned or evictable)."""
        return len(self._hash_to_page)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- allocation ---------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n fresh pages (ref count 1, no hash): free ones first, then evicted cached ones."""
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)  # least recently released
                del self._hash_to_page[self._page_hash[page]]
                self._page_hash[page] = None
                self.num_evictions += 1
            self._ref_counts[page] = 1
            pages.append(page)
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; a page nobody holds any more becomes free, or
        evictable if it is cached. Pages released later are evicted later."""
        for p in pages:
            if self._ref_counts[p] <= 0:
                raise RuntimeError(f"page {p} freed but not owned")
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                if self._page_hash[p] is None:
                    self._free.append(p)
                else:
                    self._evictable[p] = None

    # ---- prefix cache -------------------------------------------------------------------

    def lookup(self, page_hash: bytes) -> int | None:
        """The cached page holding this hash's K/V, or None."""
        return self._hash_to_page.get(page_hash)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def acquire(self, pages: Iterable[int]) -> None:
        """Take one more reference to each cached page (found with `lookup`)."""
        for p in pages:
            if self._page_hash[p] is None:
                raise RuntimeError(f"page {p} is not cached; only cached pages can be shared")
            if self._ref_counts[p] == 0:
                del self._evictable[p]
            self._ref_counts[p] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def register(self, page: int, page_hash: bytes) -> bool:
        """Cache an owned, full, computed page under its hash. False (and nothing changes)
        if another page already holds that hash (two requests computed the same prefix in
        the same step): this one stays private and is freed, not cached, when released."""
        if self._ref_counts[page] <= 0:
            raise RuntimeError(f"page {page} registered but not owned")
        if self._page_hash[page] is not None:
            if self._page_hash[page] != page_hash:
                raise RuntimeError(f"page {page} is already cached under another hash")
            return True
        if page_hash in self._hash_to_page:
            return False
        self._page_hash[page] = page_hash
        self._hash_to_page[page_hash] = page
        return True

    def page_hash(self, page: int) -> bytes | None:
        return self._page_hash[page]

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached page (they become free); pages in use keep their
        hashes. Returns how many pages were dropped."""
        dropped = 0
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._hash_to_page[self._page_hash[page]]
            self._page_hash[page] = None
            self._free.append(page)
            dropped += 1
        return dropped

    # ---- the invariant ------------------------------------------------------------------

    def check_invariant(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise RuntimeError if the page accounting is broken.

        `owners`: the page lists of every request that holds pages (a page shared by k
        requests appears in k lists).
        """
        owned = Counter(p for pages in owners for p in pages)
        free = set(self._free)
        evictable = set(self._evictable)
        if len(free) != len(self._free):
            raise RuntimeError("a page is on the free list twice")
        both = free & set(owned)
        if both:
            raise RuntimeError(f"pages both free and owned: {sorted(both)[:10]}")
        both = evictable & set(owned)
        if both:
            raise RuntimeError(f"pages both evictable and owned: {sorted(both)[:10]}")
        both = free & evictable
        if both:
            raise RuntimeError(f"pages both free and evictable: {sorted(both)[:10]}")
        for p in range(self.num_pages):
            if self._ref_counts[p] != owned.get(p, 0):
                raise RuntimeError(
                    f"page {p}: ref count {self._ref_counts[p]} but {owned.get(p, 0)} owners"
                )
        if len(free) + len(evictable) + len(owned) != self.num_pages:
            raise RuntimeError(
                f"free ({len(free)}) + evictable ({len(evictable)}) + owned ({len(owned)}) "
                f"!= total ({self.num_pages})"
            )
        for p in free:
            if self._page_hash[p] is not None:
                raise RuntimeError(f"free page {p} still has a hash")
        for p in evictable:
            if self._page_hash[p] is None:
                raise RuntimeError(f"evictable page {p} has no hash")
        hashed = {p for p in range(self.num_pages) if self._page_hash[p] is not None}
        if len(hashed) != len(self._hash_to_page) or any(
            self._page_hash[p] != h for h, p in self._hash_to_page.items()
        ):
            raise RuntimeError("the hash -> page map disagrees with the pages' hashes")
