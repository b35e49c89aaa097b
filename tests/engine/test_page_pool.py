"""PagePool: free list, ref counts, and the accounting invariant."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxcb.engine.page_pool import OutOfPagesError, PagePool


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


class PagePoolMachine(RuleBasedStateMachine):
    """Random allocate / free sequences against a model of who owns what."""

    @initialize(num_pages=st.integers(1, 40))
    def make_pool(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages)
        self.owners: list[list[int]] = []
        self.peak = 0

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
        self.owners.append(pages)
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
        used = sum(len(o) for o in self.owners)
        assert self.pool.num_used == used and self.pool.num_free == self.pool.num_pages - used
        assert self.pool.peak_used == self.peak

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            for o in self.owners:
                self.pool.free(o)
            assert self.pool.num_free == self.pool.num_pages
            self.pool.check_invariant([])


TestPagePoolMachine = PagePoolMachine.TestCase
TestPagePoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
