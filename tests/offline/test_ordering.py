"""Offline orders (jaxcb/offline/ordering.py) in pure Python: every plan is a permutation, the
requests sharing a prefix are contiguous (at every depth of the prefix tree), each follower's
leader is the first request through its deepest shared page, `auto` puts decode-heavy work
first, and StagedSubmission holds followers back exactly until their leader is released."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcb.offline.ordering import ORDERS, OrderPlan, StagedSubmission, plan_order

PAGE = 4


def shared_pages(a: list[int], b: list[int], page_size: int = PAGE) -> int:
    """Full pages two prompts have in common from their start."""
    n = 0
    while (n + 1) * page_size <= min(len(a), len(b)):
        if a[n * page_size : (n + 1) * page_size] != b[n * page_size : (n + 1) * page_size]:
            break
        n += 1
    return n


@st.composite
def workloads(draw) -> tuple[list[list[int]], list[int]]:
    """Prompts built from a few shared stems (nested: a stem may extend another), in a
    shuffled order, over a tiny alphabet so accidental sharing happens too."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    stems: list[list[int]] = [[]]
    for _ in range(draw(st.integers(0, 5))):
        base = rng.choice(stems)
        stems.append(base + [rng.randrange(3) for _ in range(rng.randrange(1, 3 * PAGE))])
    n = draw(st.integers(0, 30))
    prompts = [
        rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(1, 2 * PAGE))]
        for _ in range(n)
    ]
    decode = [rng.randrange(1, 100) for _ in range(n)]
    return prompts, decode


@settings(max_examples=200, deadline=None)
@given(workloads(), st.sampled_from(ORDERS))
def test_plans_are_permutations_with_contiguous_groups_and_first_leaders(workload, order):
    prompts, decode = workload
    plan = plan_order(prompts, decode, PAGE, order)
    assert sorted(plan.order) == list(range(len(prompts)))
    if order == "arrival":
        assert plan.order == list(range(len(prompts)))
        assert plan.after == [None] * len(prompts)
        return
    # Contiguous groups at every depth: requests sharing their first d pages form one run.
    runs: dict[tuple[int, ...], list[int]] = {}
    for p, i in enumerate(plan.order):
        for d in range(1, len(prompts[i]) // PAGE + 1):
            runs.setdefault(tuple(prompts[i][: d * PAGE]), []).append(p)
    for positions in runs.values():
        assert positions == list(range(positions[0], positions[-1] + 1))
    position = {i: p for p, i in enumerate(plan.order)}
    for p, i in enumerate(plan.order):
        earlier = [shared_pages(prompts[i], prompts[j]) for j in plan.order[:p]]
        usable = min(max(earlier, default=0), (len(prompts[i]) - 1) // PAGE)
        if usable == 0:
            assert plan.after[i] is None
            continue
        # The leader: the first request emitted through the same `usable` pages.
        leader = next(j for j in plan.order if shared_pages(prompts[i], prompts[j]) >= usable)
        assert plan.after[i] == leader and position[leader] < p


def test_prefix_keeps_the_input_order_of_what_shares_nothing():
    a, b, c = [1] * 8, [2] * 8, [3] * 3  # two pages each; a short one
    prompts = [[*a, 5], [*b, 6], c, [*a, 7], b[:4] + [9] * 4, [4] * 9]
    plan = plan_order(prompts, [1] * 6, PAGE, "prefix")
    # groups by first arrival: {0, 3}, {1, 4}, then 2 and 5 where they came
    assert plan.order == [0, 3, 1, 4, 2, 5]
    assert plan.after == [None, None, None, 0, 1, None]
    # no sharing at all: the input order, nothing held
    lone = [[i] * 9 for i in range(5)]
    assert plan_order(lone, [1] * 5, PAGE, "prefix") == OrderPlan(list(range(5)), [None] * 5)


def test_auto_puts_decode_heavy_work_first_and_counts_a_shared_prefix_once():
    prefix = list(range(10, 42))  # 8 pages
    prompts = [[1] * 5, [*prefix, 1], [*prefix, 2], [*prefix, 3], [7] * 40, [8] * 3]
    decode = [10, 20, 20, 20, 41, 300]
    # ratios, decode over prompt tokens to compute: 5: 300 / 3; 0: 10 / (4 + 1); the group
    # 60 / (32 + 3 tails) = 1.7 (0.6 if each of the three paid for the prefix); 4: 41 / 41
    plan = plan_order(prompts, decode, PAGE, "auto")
    assert plan.order == [5, 0, 1, 2, 3, 4]
    assert plan.after == [None, None, 1, 1, None, None]
    assert plan_order(prompts, decode, PAGE, "prefix").order == [0, 1, 2, 3, 4, 5]
    # within a group the decode-heavy go first, and the first of them leads
    decode = [10, 1, 50, 20, 41, 300]
    plan = plan_order(prompts, decode, PAGE, "auto")  # the group: 71 / 35 > 0's 2.0
    assert plan.order == [5, 2, 3, 1, 0, 4]
    assert plan.after == [None, 2, None, 2, None, None]


def test_a_short_prompt_that_is_a_page_of_another_leads_it_only_if_the_other_can_use_it():
    page = [1, 2, 3, 4]
    prompts = [page, [*page, 5], page]  # the third can only match pages before its last token
    plan = plan_order(prompts, [1, 1, 1], PAGE, "prefix")
    assert plan.order == [0, 1, 2]
    assert plan.after == [None, 0, None]


def test_bad_arguments():
    with pytest.raises(ValueError, match="order must be one of"):
        plan_order([[1]], [1], PAGE, "lifo")
    with pytest.raises(ValueError, match="decode lengths"):
        plan_order([[1]], [], PAGE, "auto")
    with pytest.raises(ValueError, match="page_size"):
        plan_order([[1]], [1], 0, "prefix")
    assert plan_order([], [], PAGE, "auto") == OrderPlan([], [])


def test_staged_submission_holds_followers_until_their_leader_is_released():
    # order 3, 0, 1, 2, 4: 0 and 1 follow 3; 4 follows 1
    plan = OrderPlan([3, 0, 1, 2, 4], [3, 3, None, None, 1])
    staged = StagedSubmission(plan)
    assert staged.next_ready() == 3 and staged.is_leader(3)
    assert staged.next_ready() == 2  # 0 and 1 wait for 3; 2 does not
    assert staged.next_ready() is None and staged.num_left == 3
    staged.release(2)  # not a leader: nothing changes
    assert staged.next_ready() is None
    staged.release(3)
    assert not staged.is_leader(3)
    assert [staged.next_ready(), staged.next_ready()] == [0, 1]  # plan order, not release order
    assert staged.is_leader(1) and staged.next_ready() is None
    staged.release(1)
    staged.release(1)  # twice: nothing more
    assert staged.next_ready() == 4 and staged.next_ready() is None and staged.num_left == 0

    # one open leader: order 3, 0, 1, 2; 0 follows 3, 2 follows 1; 1 (a leader) waits
    # until 3 is released
    plan = OrderPlan([3, 0, 1, 2], [3, None, 1, None])
    one = StagedSubmission(plan, open_leaders=1)
    assert one.next_ready() == 3 and one.next_ready() is None
    one.release(3)
    assert [one.next_ready(), one.next_ready(), one.next_ready()] == [0, 1, None]
    one.release(1)
    assert one.next_ready() == 2 and one.num_left == 0
    with pytest.raises(ValueError, match="open_leaders"):
        StagedSubmission(plan, open_leaders=0)

    plan = OrderPlan([3, 0, 1, 2, 4], [3, 3, None, None, 1])
    free = StagedSubmission(plan, hold=False)
    assert [free.next_ready() for _ in range(5)] == [3, 0, 1, 2, 4]
    assert not free.is_leader(3)
