"""Preemption by swap: the host swap space's bookkeeping and the recompute-or-swap choice.

When the scheduler preempts a running request (`Scheduler._reserve_pages`), its KV pages
either go (`preemption_mode`)

recompute  freed; the request is prefilled again from its first uncached page when it is
           re-admitted (what vLLM calls recompute);
swap       copied into a bounded pool of host memory (`swap_space_gb`) and freed; when the
           request is re-admitted, fresh pages are allocated and the copies go back into
           them, so it resumes with every computed token intact and no prefill;
auto       per victim, whichever the cost model below expects to be cheaper.

The host pool is a fixed number of page-sized slots (`SwapSpace`: a free list of plain
ints here; the arrays live in jaxcb/runtime/kv_swap.py). A victim needs one slot per page
of its computed tokens; if that many are not free it is recomputed instead and counted
(`num_fallbacks`), so the pool's bound never blocks a preemption.

The cost model (`SwapCostModel`), per victim with t computed tokens in p pages of B bytes:

    recompute = (1 - c) * t / prefill_tokens_per_s     swap = (2 - c) * p * B / bytes_per_s

`bytes_per_s` is the device-host bandwidth the runner measures once at start-up (a copy of
a few MiB of pages out and back in; runtime/runner.py); `prefill_tokens_per_s` is measured
from the engine's own steps (`observe_step`): the mean rate of the recent steps that filled
at least half the token budget (prefill-heavy steps, whose rate is what a recompute costs),
or, before any such step, of all steps so far (slower per token: small steps pay their fixed
cost on few tokens, so the estimate errs towards swapping). Both are marginal costs: a
recompute's chunks share steps with other requests' decodes, and a swap's copies run at the
start of a step. `c` is the share of a victim's computed tokens that the prefix cache still
holds when it comes back (`observe_resume`, a moving average over the victims re-admitted so
far, swapped or recomputed; 0 before any, and always 0 without prefix caching): a preempted
request's cached pages stay in the cache until evicted, so its recompute starts after them,
and its swap copies back only the pages it lost. Under light pressure `c` is close to 1 and
`auto` recomputes (nearly free); when the cache churns `c` falls and `auto` swaps.

Pure Python: no jax. The copies themselves are the runner's (`Runner.swap`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from jaxcb.config.sections import PREEMPTION_MODES

#: Steps filling at least this share of the token budget measure the prefill rate.
PREFILL_STEP_SHARE = 0.5
#: Weight of the newest observation in the moving averages (prefill rate, cached share).
RATE_SMOOTHING = 0.2


class SwapSpace:
    """Host slots of one KV page each: which are free. Every slot is either free or held
    by exactly one swapped-out request (`check_invariant`)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._is_free = [True] * num_slots
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        slots = [self._free.popleft() for _ in range(n)]
        for slot in slots:
            self._is_free[slot] = False
        self.peak_used = max(self.peak_used, self.num_used)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if not 0 <= slot < self.num_slots or self._is_free[slot]:
                raise RuntimeError(f"swap slot {slot} freed but not held")
            self._is_free[slot] = True
            self._free.append(slot)

    def check_invariant(self, owners: Iterable[Iterable[int]]) -> None:
        """RuntimeError unless free + held == all, each slot once (`owners`: the slot lists
        of every swapped-out request)."""
        held = [s for slots in owners for s in slots]
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a swap slot is on the free list twice")
        if len(set(held)) != len(held):
            raise RuntimeError("a swap slot is held by two requests")
        both = free.intersection(held)
        if both:
            raise RuntimeError(f"swap slots both free and held: {sorted(both)[:10]}")
        if len(free) + len(held) != self.num_slots:
            raise RuntimeError(
                f"swap slots: free ({len(free)}) + held ({len(held)}) != total ({self.num_slots})"
            )


class SwapCostModel:
    """Seconds a victim costs to recompute or to swap out and back; see the module docstring."""

    def __init__(self, *, page_bytes: int, bytes_per_s: float, max_num_batched_tokens: int) -> None:
        if page_bytes <= 0 or bytes_per_s <= 0:
            raise ValueError(
                f"page_bytes and bytes_per_s must be > 0, got {page_bytes} and {bytes_per_s}"
            )
        self.page_bytes = page_bytes
        self.bytes_per_s = bytes_per_s
        self.min_prefill_step_tokens = max(1, int(PREFILL_STEP_SHARE * max_num_batched_tokens))
        self._rate: float | None = None  # moving average over prefill-heavy steps
        self.cached_share = 0.0  # c above: moving average over re-admitted victims
        self._tokens = 0  # all steps so far (the fallback rate)
        self._seconds = 0.0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """One step ran `num_tokens` real tokens in `seconds` of device time."""
        if seconds <= 0 or num_tokens <= 0:
            return
        self._tokens += num_tokens
        self._seconds += seconds
        if num_tokens >= self.min_prefill_step_tokens:
            rate = num_tokens / seconds
            old = self._rate
            self._rate = rate if old is None else old + RATE_SMOOTHING * (rate - old)

    def observe_resume(self, num_tokens: int, num_cached_tokens: int) -> None:
        """A victim that had `num_tokens` computed came back and found `num_cached_tokens`
        of them in the prefix cache."""
        if num_tokens > 0:
            share = min(num_cached_tokens, num_tokens) / num_tokens
            self.cached_share += RATE_SMOOTHING * (share - self.cached_share)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The measured prefill rate; None before any step."""
        if self._rate is not None:
            return self._rate
        return self._tokens / self._seconds if self._seconds > 0 else None

    def recompute_seconds(self, num_tokens: int) -> float:
        rate = self.prefill_tokens_per_s
        return float("inf") if rate is None else (1 - self.cached_share) * num_tokens / rate

    def swap_seconds(self, num_pages: int) -> float:
        return (2 - self.cached_share) * num_pages * self.page_bytes / self.bytes_per_s

    def prefers_swap(self, num_tokens: int, num_pages: int) -> bool:
        return self.swap_seconds(num_pages) < self.recompute_seconds(num_tokens)


class Swapper:
    """What the scheduler asks at each preemption: host slots for the victim's pages (swap)
    or None (recompute), by `mode`, the host pool's room and the cost model (auto; without
    one, as when the host pool has no slot to measure the bandwidth with, it swaps)."""

    def __init__(self, mode: str, space: SwapSpace, cost: SwapCostModel | None = None) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {list(PREEMPTION_MODES)}, got {mode!r}"
            )
        self.mode = mode
        self.space = space
        self.cost = cost
        self.num_swapped_out = 0  # victims whose pages went to the host
        self.num_swapped_in = 0  # of them, resumed with their computed tokens
        self.num_fallbacks = 0  # victims recomputed because the host pool was full

    def slots_for(self, num_tokens: int, num_pages: int) -> list[int] | None:
        """Host slots for a victim with `num_tokens` computed tokens in `num_pages` pages,
        or None: recompute it."""
        if self.mode == "recompute" or num_pages == 0:
            return None
        auto = self.mode == "auto" and self.cost is not None
        if auto and not self.cost.prefers_swap(num_tokens, num_pages):
            return None
        slots = self.space.allocate(num_pages)
        if slots is None:
            self.num_fallbacks += 1
        else:
            self.num_swapped_out += 1
        return slots

    def observe_resume(self, num_tokens: int, num_cached_tokens: int) -> None:
        """A victim re-admitted (see SwapCostModel.observe_resume)."""
        if self.cost is not None:
            self.cost.observe_resume(num_tokens, num_cached_tokens)
