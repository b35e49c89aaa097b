"""The ITL controller: each step's token budget, steered by the measured inter-token latency.

A big token budget per step helps TTFT and throughput (a long prompt goes through in few
chunks); a small one protects the inter-token latency (ITL) of the running requests, since
each of them waits for the whole step. The right budget depends on the traffic, so with
`itl_target_ms` set the engine asks this controller for it every step.

What it measures: an ITL sample per step that gives a decoding request a token, the wall time
from the end of the previous step to the end of this one (LLMEngine.step), so the work the
caller does between steps counts as it does for the client. What it chooses: always one of
the precompiled token buckets, so no step ever needs a new shape.

The rules (tail = the nearest-rank `percentile` of the ITL samples in the window; the
window restarts at every change, so it only ever holds samples taken at the current budget):

- cut: as soon as enough samples exceed the target that the full window's tail must exceed
  it too, the budget drops to the largest smaller bucket whose predicted step time fits under
  `headroom` x target: several buckets at once when the predictions say so (a multiplicative
  decrease), one when nothing is known. The prediction is a per-bucket moving average of the
  samples, or, for a bucket not seen yet, the average of the nearest larger seen bucket
  scaled by the token ratio (optimistic: fixed costs do not shrink; the feedback corrects).
- raise: after a full window at the current budget whose tail is under `headroom` x target,
  in which at least half the steps ran at the budget (otherwise the budget was not what was
  measured), one bucket up; not while the next bucket's average, if measured within the
  last 8 windows' worth of steps, exceeds the target. A bucket the budget was cut from
  waits 2, 4, then 8 windows before it is tried again, and a full window within the target
  there clears its strikes, so a budget on the edge probes rarely instead of oscillating.
- between `headroom` x target and the target: hold (the hysteresis band).
- the floor: a step's budget is at least the smallest bucket that holds its running decodes
  plus `min_prefill_tokens`, so decodes are never cut and prefill always moves; a step
  without decodes keeps nobody waiting and gets the largest bucket.

The budget starts at the largest bucket (the fixed budget without a controller) and is cut
at the first sign of a tail.

Without a target, `min_token_budget` shares the largest budget by a simpler rule
(`shared_token_budget`): max_num_batched_tokens over the running decodes, at least the floor.
Pure Python, no jax.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

MAX_STRIKES = 3  # a bucket cut from waits at most 2**3 windows before it is tried again


class ITLController:
    """Chooses each step's token budget among `token_buckets`; see the module docstring."""

    def __init__(
        self,
        token_buckets: Sequence[int],
        *,
        target_ms: float,
        percentile: float = 0.9,
        window: int = 64,
        min_prefill_tokens: int = 16,
        headroom: float = 0.8,
        ema_weight: float = 0.2,
    ) -> None:
        buckets = sorted({int(b) for b in token_buckets})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"token_buckets must be non-empty and >= 1, got {list(token_buckets)}")
        if not target_ms > 0:
            raise ValueError(f"itl_target_ms must be > 0, got {target_ms}")
        if not 0 < percentile < 1:
            raise ValueError(f"itl_percentile must be in (0, 1), got {percentile}")
        if window < 2:
            raise ValueError(f"itl_window must be >= 2, got {window}")
        if min_prefill_tokens < 1:
            raise ValueError(f"itl_min_prefill_tokens must be >= 1, got {min_prefill_tokens}")
        if not 0 < headroom < 1:
            raise ValueError(f"headroom must be in (0, 1), got {headroom}")
        if not 0 < ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {ema_weight}")
        self.buckets = tuple(buckets)
        self.target = target_ms / 1000.0
        self.percentile = percentile
        self.window = window
        self.min_prefill_tokens = min_prefill_tokens
        self.headroom = headroom
        self.ema_weight = ema_weight
        # Samples above the target a full window may hold while its tail stays within it.
        self._allowed_above = window - math.ceil(percentile * window)
        self._index = len(self.buckets) - 1
        self._samples: deque[tuple[float, bool]] = deque(maxlen=window)  # (seconds, binding)
        self._since_change = 0  # ITL samples since the last change
        self._ema: list[float | None] = [None] * len(self.buckets)
        self._ema_step = [0] * len(self.buckets)  # the step count at its last update
        self._strikes = [0] * len(self.buckets)
        self._num_steps = 0
        self.num_samples = 0  # ITL samples fed
        self.num_cuts = 0
        self.num_raises = 0

    @property
    def budget(self) -> int:
        """The controller's current budget (a bucket size); see `step_budget` for a step's."""
        return self.buckets[self._index]

    def step_budget(self, num_decodes: int) -> int:
        """The token budget of a step that starts with `num_decodes` running decodes."""
        if num_decodes == 0:
            return self.buckets[-1]
        need = num_decodes + self.min_prefill_tokens
        floor = self.buckets[min(bisect.bisect_left(self.buckets, need), len(self.buckets) - 1)]
        return max(self.budget, floor)

    def tail(self) -> float | None:
        """The window's nearest-rank percentile ITL, seconds (None before any sample)."""
        if not self._samples:
            return None
        ordered = sorted(s for s, _ in self._samples)
        return ordered[math.ceil(self.percentile * len(ordered)) - 1]

    def predict(self, index: int) -> float | None:
        """Predicted seconds of a step at bucket `index`: its moving average, else the nearest
        larger seen bucket's scaled down by the token ratio; None when nothing is known."""
        for j in range(index, len(self.buckets)):
            ema = self._ema[j]
            if ema is not None:
                return ema * self.buckets[index] / self.buckets[j]
        return None

    def feed(self, step_seconds: float, had_decode: bool, bucket_tokens: int) -> int:
        """One step ran in `bucket_tokens`' bucket: `step_seconds` (its ITL sample when it
        `had_decode`). Returns the budget for the steps to come."""
        if bucket_tokens not in self.buckets:
            raise ValueError(f"bucket_tokens={bucket_tokens} is not one of {list(self.buckets)}")
        i = self.buckets.index(bucket_tokens)
        ema = self._ema[i]
        w = self.ema_weight
        self._ema[i] = step_seconds if ema is None else (1 - w) * ema + w * step_seconds
        self._num_steps += 1
        self._ema_step[i] = self._num_steps
        if not had_decode:
            return self.budget
        self.num_samples += 1
        self._samples.append((step_seconds, bucket_tokens >= self.budget))
        self._since_change += 1
        above = sum(s > self.target for s, _ in self._samples)
        if above > self._allowed_above:
            self._cut()
        elif self._since_change >= self.window:
            self._maybe_raise()
        return self.budget

    # ---- internals ----------------------------------------------------------------------

    def _cut(self) -> None:
        if self._index == 0:
            self._restart()  # already the smallest: nothing to cut, but measure afresh
            return
        fits = self.headroom * self.target
        new = self._index - 1
        for i in range(self._index - 1, -1, -1):
            predicted = self.predict(i)
            if predicted is None:
                break  # nothing known here: one bucket down
            new = i
            if predicted <= fits:
                break  # the largest that fits (or, if none does, the smallest)
        self._strikes[self._index] = min(self._strikes[self._index] + 1, MAX_STRIKES)
        self._index = new
        self.num_cuts += 1
        self._restart()

    def _maybe_raise(self) -> None:
        """A full window at the current budget, its tail within the target (no cut)."""
        if 2 * sum(b for _, b in self._samples) < len(self._samples):
            return  # mostly smaller steps: the budget itself was not measured
        self._strikes[self._index] = 0  # the target held here
        fits = self.headroom * self.target
        if sum(s > fits for s, _ in self._samples) > self._allowed_above:
            return  # the tail is in the hysteresis band: hold
        up = self._index + 1
        if up == len(self.buckets) or self._since_change < self.window << self._strikes[up]:
            return
        ema = self._ema[up]
        recent = self._num_steps - self._ema_step[up] <= self.window << MAX_STRIKES
        if ema is not None and recent and ema > self.target:
            return  # measured too slow, and recently
        self._index = up
        self.num_raises += 1
        self._restart()

    def _restart(self) -> None:
        self._samples.clear()
        self._since_change = 0


def shared_token_budget(buckets: list[int], largest: int, floor: int, num_decodes: int) -> int:
    """`largest` tokens shared by `num_decodes` running decodes, at least `floor` and every
    decode's token, as a token bucket (nothing is padded for it): each decode waits for the
    step, so a prompt goes through in one step while one request decodes and in
    `floor`-token chunks while many do. No decodes: `largest`."""
    if num_decodes == 0:
        return largest
    need = max(floor, num_decodes)  # (every decode keeps its token)
    share = max(need, largest // num_decodes)
    fitting = [b for b in buckets if need <= b <= share]
    if fitting:
        return fitting[-1]
    above = [b for b in buckets if b >= need]  # (the step pads to it anyway)
    return min(above[0], largest) if above else largest
