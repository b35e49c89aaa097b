"""Offline submission orders for a batch known up front: `LLM.generate(..., order=...)` and
`batch_infer.py --order`. An order changes when each request enters the engine, never what it
computes: every request's tokens are the same in any order.

Under fcfs the engine admits in submission order, so an order is a plan of submissions:

arrival  the input order (what the engine did before orders existed).
prefix   a prefix tree over the prompts' full KV pages (one node a page of `page_size` tokens,
         the unit the prefix cache shares); a depth-first walk emits the requests that share a
         page next to each other, those sharing the longest prefix closest together, so a
         shared prefix is computed once and its pages stay held while its group runs.
         Siblings go in order of first arrival: requests that share nothing keep their input
         order.
auto     the same tree and walk, but the siblings at each node (its subtrees, and the requests
         whose prompts end at it) sorted by decode-to-prefill ratio, largest first, ties by
         first arrival. An item's ratio is the max_tokens (times n) of its requests over the
         prompt tokens it must compute itself, its parent's pages being cached: its own pages
         plus each request's tail past its last full page. Decode-heavy work starts first, and
         its long decodes then share steps with the prefill chunks of the prefill-heavy work
         behind it, instead of a tail of decode-only steps at the end (BatchLLM,
         arXiv:2412.03594). A group's shared prefix counts once, so a large group rates as the
         sum of its requests' decodes over one prefix plus their tails.

Leaders and followers: two requests with a common page that the engine admits in the same
step both miss the cache (a page is cached once the step that fills it has run) and compute
it twice. So a request that shares pages with an earlier one in the plan (a follower) is held
back until the first request through its deepest shared page (its leader) has finished its
prefill. `StagedSubmission` does that bookkeeping for the callers, which tell it when a
leader's first token (or its end) arrives.

Pure Python: no jax. Building the tree costs O(total prompt tokens), sorting siblings
O(n log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ORDERS = ("arrival", "prefix", "auto")


@dataclass(frozen=True)
class OrderPlan:
    """A submission plan for n requests (indices into the caller's list)."""

    order: list[int]  # submission order: a permutation of range(n)
    after: list[int | None]  # per request: its leader, whose prefill must be done first


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {list(ORDERS)}, got {order!r}")


def plan_order(
    prompts: Sequence[Sequence[int]],
    decode_tokens: Sequence[int],
    page_size: int,
    order: str,
) -> OrderPlan:
    """The plan for `order` (see the module docstring). `prompts`: token ids; `decode_tokens`:
    each request's output budget (max_tokens times n), which only `auto` reads."""
    check_order(order)
    if len(decode_tokens) != len(prompts):
        raise ValueError(f"got {len(decode_tokens)} decode lengths for {len(prompts)} prompts")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    n = len(prompts)
    if order == "arrival":
        return OrderPlan(list(range(n)), [None] * n)
    root = _build_tree(prompts, page_size)
    _summarize(root, prompts, decode_tokens, page_size)

    def key(item: _Item) -> tuple:
        if order == "prefix":
            return (_first(item),)
        return (-_ratio(item, prompts, decode_tokens, page_size), _first(item))

    return _walk(root, prompts, page_size, key)


class _Node:
    """A full page of tokens, reached from the root through the pages before it."""

    __slots__ = ("children", "decode", "depth", "first", "prefill", "requests")

    def __init__(self, depth: int) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.requests: list[int] = []  # prompts whose last full page is this one
        self.depth = depth  # pages from the root
        self.first = 0  # the smallest request index in the subtree
        self.decode = 0  # decode tokens of the subtree's requests
        self.prefill = 0  # tokens the subtree computes if its parent's pages are cached


_Item = _Node | int  # a subtree, or a request ending at the node


def _build_tree(prompts: Sequence[Sequence[int]], page_size: int) -> _Node:
    root = _Node(0)
    for i, prompt in enumerate(prompts):
        node = root
        for k in range(len(prompt) // page_size):
            page = tuple(prompt[k * page_size : (k + 1) * page_size])
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(node.depth + 1)
            node = child
        node.requests.append(i)
    return root


def _tail(prompt: Sequence[int], page_size: int) -> int:
    """Tokens a prompt computes past its last full page (at least its last one): its node
    is at depth len(prompt) // page_size."""
    return max(1, len(prompt) % page_size)


def _summarize(
    root: _Node, prompts: Sequence[Sequence[int]], decode: Sequence[int], page_size: int
) -> None:
    """Fill in every node's first, decode and prefill, children before parents."""
    preorder, stack = [], [root]
    while stack:
        node = stack.pop()
        preorder.append(node)
        stack.extend(node.children.values())
    for node in reversed(preorder):
        kids = node.children.values()
        node.first = min([*node.requests, *(c.first for c in kids)], default=0)  # empty: root
        node.decode = sum(decode[i] for i in node.requests) + sum(c.decode for c in kids)
        node.prefill = (page_size if node.depth else 0) + sum(c.prefill for c in kids)
        node.prefill += sum(_tail(prompts[i], page_size) for i in node.requests)


def _first(item: _Item) -> int:
    return item.first if isinstance(item, _Node) else item


def _ratio(
    item: _Item, prompts: Sequence[Sequence[int]], decode: Sequence[int], page_size: int
) -> float:
    if isinstance(item, _Node):
        return item.decode / item.prefill
    return decode[item] / _tail(prompts[item], page_size)


def _walk(
    root: _Node,
    prompts: Sequence[Sequence[int]],
    page_size: int,
    key: Callable[[_Item], tuple],
) -> OrderPlan:
    """Depth-first, siblings by `key`; each request's leader is the first request emitted
    through the deepest page it shares with an earlier one (and can take from the cache:
    never its last token's page)."""
    n = len(prompts)
    order: list[int] = []
    after: list[int | None] = [None] * n
    path: list[_Node] = []  # the nodes from depth 1 down to the current one
    leaders: list[int] = []  # leaders[k]: the first request emitted through path[k]
    stack = [iter(_sorted_items(root, key))]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
            if path:
                path.pop()
                del leaders[len(path) :]
        elif isinstance(item, _Node):
            path.append(item)
            stack.append(iter(_sorted_items(item, key)))
        else:
            shared = min(len(leaders), (len(prompts[item]) - 1) // page_size)
            if shared >= 1:
                after[item] = leaders[shared - 1]
            leaders.extend([item] * (len(path) - len(leaders)))
            order.append(item)
    return OrderPlan(order, after)


def _sorted_items(node: _Node, key: Callable[[_Item], tuple]) -> list[_Item]:
    return sorted([*node.requests, *node.children.values()], key=key)


class StagedSubmission:
    """Hands out a plan's requests in plan order, holding each follower back until its
    leader's prefill is done.

    `next_ready()` gives the earliest request (in plan order) that may be submitted now, or
    None; `release(leader)` once the leader's first token, its end, or its rejection is seen
    (more calls do nothing). Nothing deadlocks: a leader comes before its followers in the
    plan, so it is handed out, and released, first. `hold=False` (no prefix cache: holding
    back would gain nothing) hands out everything in plan order at once.

    At most `open_leaders` leaders are out and unreleased at a time: the next leader waits
    (and everything after it in the plan) until one is released. Without that bound every
    group's leader would be queued in the engine before the first group's followers, so the
    groups would run side by side, as in arrival order, and with a KV pool too small for all
    their prefixes a group's pages could be evicted before its followers arrive. Two keep a
    step's prefill budget busy (one leader's prompt runs while the next waits) and let the
    groups enter one after another.
    """

    def __init__(self, plan: OrderPlan, *, hold: bool = True, open_leaders: int = 2) -> None:
        if open_leaders < 1:
            raise ValueError(f"open_leaders must be >= 1, got {open_leaders}")
        self._open_limit = open_leaders
        self._open: set[int] = set()  # leaders handed out and not released
        self._order = plan.order
        self._position = [0] * len(plan.order)
        for pos, i in enumerate(plan.order):
            self._position[i] = pos
        after = plan.after if hold else [None] * len(plan.order)
        self._ready = [self._position[i] for i, lead in enumerate(after) if lead is None]
        heapq.heapify(self._ready)
        self._followers: dict[int, list[int]] = {}
        for i, lead in enumerate(after):
            if lead is not None:
                self._followers.setdefault(lead, []).append(i)
        self.num_left = len(plan.order)  # not handed out yet

    def next_ready(self) -> int | None:
        if not self._ready:
            return None
        i = self._order[self._ready[0]]
        if i in self._followers:
            if len(self._open) >= self._open_limit:
                return None
            self._open.add(i)
        heapq.heappop(self._ready)
        self.num_left -= 1
        return i

    def is_leader(self, i: int) -> bool:
        """Some request still waits for i's prefill: report its first token."""
        return i in self._followers

    def release(self, i: int) -> None:
        self._open.discard(i)
        for follower in self._followers.pop(i, ()):
            heapq.heappush(self._ready, self._position[follower])
