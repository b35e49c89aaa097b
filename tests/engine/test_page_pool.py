"""PagePool: free list, ref counts, the prefix cache (hashes, sharing, LRU eviction), and the
accounting invariant."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxcb.engine.sched.page_pool import OutOfPagesError, PagePool, hash_page


def test_rejects_empty_pool() -> None:
    for n in (0, -3):
        with pytest.raises(ValueError, match="num_pages"):
            PagePool(n)


def test_allocate_and_free_counts() -> None:
    pool = PagePool(8)
    assert (pool.num_free, pool.num_used, pool.usage) == (8, 0, 0.0)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and set(a) | set(b) == set(range(8))
    assert (pool.num_free, pool.num_used, pool.usage, pool.peak_used) == (0, 8, 1.0, 8)
    assert not pool.can_allocate(1) and pool.can_allocate(0)
    pool.check_invariant([a, b])
    pool.free(a)
    assert pool.num_free == 3 and pool.peak_used == 8
    pool.check_invariant([b])
    assert pool.allocate(0) == []


def test_out_of_pages_changes_nothing() -> None:
    pool = PagePool(4)
    held = pool.allocate(3)
    with pytest.raises(OutOfPagesError, match="2 pages, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_invariant([held])


def test_double_free_is_an_error() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="not owned"):
        pool.free(pages[:1])
    pool.check_invariant([])
    with pytest.raises(RuntimeError, match="not owned"):
        pool.free([3])  # never allocated


def test_freed_pages_are_reused() -> None:
    pool = PagePool(3)
    a = pool.allocate(3)
    pool.free(a[1:2])
    assert pool.allocate(1) == a[1:2]


def test_check_invariant_catches_broken_accounting() -> None:
    pool = PagePool(4)
    a = pool.allocate(2)
    with pytest.raises(RuntimeError, match="ref count"):
        pool.check_invariant([])  # an owner forgot its pages: leaked
    with pytest.raises(RuntimeError, match="both free and owned"):
        pool.check_invariant([a, [3]])  # claims a free page
    with pytest.raises(RuntimeError, match="ref count"):
        pool.check_invariant([a, a[:1]])  # two owners, ref count 1


def test_hash_page_chains_and_is_stable() -> None:
    a = hash_page(None, [1, 2, 3])
    assert a == hash_page(None, [1, 2, 3]) and len(a) == 32
    assert hash_page(None, [1, 2, 4]) != a
    assert hash_page(a, [5, 6]) != hash_page(hash_page(None, [9]), [5, 6])  # parent matters
    assert hash_page(None, [2**40, 7]) != hash_page(None, [7, 2**40])


def test_cached_pages_survive_release_and_are_shared() -> None:
    pool = PagePool(4)
    a = pool.allocate(2)
    h0, h1 = hash_page(None, [1]), hash_page(hash_page(None, [1]), [2])
    assert pool.register(a[0], h0) and pool.register(a[1], h1)
    assert pool.register(a[0], h0)  # again: a no-op
    assert pool.lookup(h0) == a[0] and pool.num_cached == 2
    pool.acquire([a[0]])  # a second request shares the page
    pool.check_invariant([a, a[:1]])
    pool.free(reversed(a))  # the first request ends
    assert pool.num_used == 1 and pool.num_evictable == 1 and pool.num_free == 3
    pool.check_invariant([a[:1]])
    pool.free(a[:1])
    assert (pool.num_used, pool.num_evictable, pool.num_free) == (0, 2, 4)
    pool.check_invariant([])
    # a later request finds both pages again; the evictable ones leave the LRU
    pool.acquire([a[0], a[1]])
    assert pool.num_evictable == 0 and pool.num_used == 2
    pool.check_invariant([a])
    pool.free(a)


def test_eviction_is_lru_and_only_when_needed() -> None:
    pool = PagePool(4)
    pages = pool.allocate(3)
    hashes = [hash_page(None, [i]) for i in range(3)]
    for p, h in zip(pages, hashes, strict=True):
        pool.register(p, h)
    pool.free([pages[2], pages[0], pages[1]])  # released in this order
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.allocate(1) == [3]  # the never-used page first: nothing evicted
    assert pool.num_evictions == 0 and pool.num_cached == 3
    assert pool.allocate(1) == [pages[2]]  # then the least recently released
    assert pool.lookup(hashes[2]) is None and pool.page_hash(pages[2]) is None
    assert pool.num_evictions == 1 and pool.lookup(hashes[0]) == pages[0]
    pool.acquire([pages[0]])  # a hit takes it out of the LRU
    assert pool.allocate(1) == [pages[1]]
    pool.check_invariant([[3], [pages[2]], [pages[0]], [pages[1]]])
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)


def test_duplicate_hash_stays_private_and_misuse_is_an_error() -> None:
    pool = PagePool(3)
    a, b = pool.allocate(1), pool.allocate(1)
    h = hash_page(None, [4, 5])
    assert pool.register(a[0], h) and not pool.register(b[0], h)
    assert pool.page_hash(b[0]) is None
    pool.free(b)
    assert pool.num_evictable == 0  # freed, not cached
    with pytest.raises(RuntimeError, match="not owned"):
        pool.register(b[0], hash_page(None, [6]))
    with pytest.raises(RuntimeError, match="another hash"):
        pool.register(a[0], hash_page(None, [7]))
    with pytest.raises(RuntimeError, match="not cached"):
        pool.acquire(pool.allocate(1))
    pool.check_invariant([a, [2]])


def test_reset_prefix_cache_drops_only_unused_pages() -> None:
    pool = PagePool(4)
    a = pool.allocate(2)
    pool.register(a[0], hash_page(None, [1]))
    pool.register(a[1], hash_page(None, [2]))
    pool.free(a[1:])
    assert pool.reset_prefix_cache() == 1
    assert pool.num_cached == 1 and pool.lookup(hash_page(None, [1])) == a[0]
    pool.check_invariant([a[:1]])


def test_check_invariant_catches_broken_cache_accounting() -> None:
    pool = PagePool(3)
    a = pool.allocate(1)
    pool.register(a[0], hash_page(None, [1]))
    pool.free(a)
    with pytest.raises(RuntimeError, match="evictable and owned"):
        pool.check_invariant([a])  # claims an evictable page
    pool._page_hash[a[0]] = None  # a cached page that lost its hash
    with pytest.raises(RuntimeError, match="evictable page"):
        pool.check_invariant([])


class PagePoolMachine(RuleBasedStateMachine):
    """Random allocate / free / cache / share sequences against a model of who owns what."""

    @initialize(num_pages=st.integers(1, 40))
    def make_pool(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages)
        self.owners: list[list[int]] = []
        self.peak = 0
        self.hashes: dict[bytes, int] = {}  # the model of the cache: hash -> page
        self.num_hashes = 0

    @rule(n=st.integers(0, 45))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(OutOfPagesError):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before
            return
        pages = self.pool.allocate(n)
        assert len(pages) == len(set(pages)) == n
        assert not set(pages) & {p for o in self.owners for p in o}
        assert all(0 <= p < self.pool.num_pages for p in pages)
        for h, p in list(self.hashes.items()):
            if p in pages:  # evicted: no longer found
                assert self.pool.lookup(h) is None
                del self.hashes[h]
        self.owners.append(pages)
        self.peak = max(self.peak, self.pool.num_used)

    @precondition(lambda self: any(self.owners))
    @rule(data=st.data(), duplicate=st.booleans())
    def register(self, data: st.DataObject, duplicate: bool) -> None:
        owner = data.draw(st.sampled_from([o for o in self.owners if o]))
        page = data.draw(st.sampled_from(owner))
        if self.pool.page_hash(page) is not None:
            return
        if duplicate and self.hashes:
            h = data.draw(st.sampled_from(sorted(self.hashes)))
            assert not self.pool.register(page, h)
            assert self.pool.lookup(h) == self.hashes[h]
            return
        self.num_hashes += 1
        h = hash_page(None, [self.num_hashes])
        assert self.pool.register(page, h)
        self.hashes[h] = page

    @precondition(lambda self: self.hashes)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.hashes)))
        page = self.pool.lookup(h)
        assert page == self.hashes[h]
        self.pool.acquire([page])
        self.owners.append([page])
        self.peak = max(self.peak, self.pool.num_used)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_one_owner(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.owners) - 1))
        self.pool.free(self.owners.pop(i))

    @precondition(lambda self: any(self.owners))
    @rule(data=st.data())
    def free_some_pages(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from([o for o in self.owners if o]))
        k = data.draw(st.integers(1, len(owner)))
        self.pool.free(owner[-k:])
        del owner[-k:]

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariant(self.owners)
        used = len({p for o in self.owners for p in o})
        assert self.pool.num_used == used and self.pool.num_free == self.pool.num_pages - used
        assert self.pool.peak_used == self.peak
        assert self.pool.num_cached == len(self.hashes)
        for h, p in self.hashes.items():
            assert self.pool.lookup(h) == p

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            for o in self.owners:
                self.pool.free(o)
            assert self.pool.num_free == self.pool.num_pages
            assert self.pool.num_evictable == len(self.hashes)
            self.pool.check_invariant([])
            self.pool.reset_prefix_cache()
            assert self.pool.num_cached == 0
            self.pool.check_invariant([])


TestPagePoolMachine = PagePoolMachine.TestCase
TestPagePoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
