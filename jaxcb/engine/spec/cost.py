"""Whether proposals pay, from measurements: SpeculationCost fits the step's seconds as
a + b * tokens over the recent steps, learns how often a proposal is kept, and picks each
step's cap on proposals per request to maximize expected tokens per second.

A proposal costs a token row in the step and brings a token only if kept. On a CPU a
single stream's step reads every weight whatever its few rows, so b is small next to a and
proposals are nearly free; a step of 64 decodes is compute-bound, so 4 proposals each
would cost ~4x the time for ~1.4x the tokens at a chat's acceptance. Both come out of the
fit (vLLM turns speculation off past a fixed batch size instead). A draft model's guesses
cost its steps too, one per guessed position. The fit is of the device's seconds; each
mode's measured wall seconds a step over the prediction (`cadence`) scales it, since
without proposals an async engine hides the host's work behind the device's and with them
it cannot.
"""

from __future__ import annotations

from collections import Counter


class SpeculationCost:
    """Step seconds against tokens, and the chance a proposal is kept (see module doc)."""

    def __init__(self, decay: float = 0.97, prior_acceptance: float = 0.5) -> None:
        """`decay`: weight kept by the past at each new observation (~1 / (1 - decay)
        steps remembered); `prior_acceptance`: assumed before any proposal was verified."""
        self.decay = decay
        self._fit = [0.0] * 5  # decayed sums of 1, x, y, x^2, xy (x tokens, y seconds)
        # decayed counts of kept proposals and of rejections (a proposal not kept), with a
        # prior worth one of each
        self._kept, self._rejected = prior_acceptance, 1.0 - prior_acceptance
        # Each mode's wall seconds a step over what the fit (and the draft's seconds) predict:
        # without proposals an async engine overlaps the host's work with the device's
        # (below 1); with them it waits for each step, and the host's work adds (above).
        self.cadence = {False: 1.0, True: 1.0}  # by "the step had proposals"

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        x, y = float(num_tokens), float(seconds)
        new = (1.0, x, y, x * x, x * y)
        self._fit = [self.decay * s + v for s, v in zip(self._fit, new, strict=True)]

    def observe_verified(self, num_proposed: int, num_kept: int) -> None:
        """A request's proposals were verified: the first `num_kept` were kept."""
        self._kept = self.decay * self._kept + num_kept
        self._rejected = self.decay * self._rejected + (num_kept < num_proposed)

    def observe_cadence(
        self, num_tokens: int, draft_seconds: float, proposed: bool, seconds: float
    ) -> None:
        """A step's wall seconds, end to end (`draft_seconds`: its draft model's part, as
        predicted), with or without proposals; a gap far off the prediction (the engine
        was idle) is ignored."""
        fit = self.step_seconds()
        if fit is None:
            return
        ratio = seconds / (fit[0] + fit[1] * num_tokens + draft_seconds)
        if 0.2 < ratio < 5.0:
            self.cadence[proposed] = self.decay * self.cadence[proposed] + (1 - self.decay) * ratio

    @property
    def acceptance(self) -> float:
        """The chance a proposal is kept, given the ones before it were."""
        return self._kept / (self._kept + self._rejected)

    def step_seconds(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * tokens; None until steps of different sizes were seen."""
        n, sx, sy, sxx, sxy = self._fit
        if n <= 0:
            return None
        var = sxx / n - (sx / n) ** 2
        if var < 0.25:  # (all steps of one size: the slope is unknown)
            return None
        b = max(0.0, (sxy / n - sx * sy / n / n) / var)
        a = max(1e-9, sy / n - b * sx / n)
        return a, b

    def best_cap(
        self,
        proposal_lengths: list[int],
        other_tokens: int,
        max_cap: int,
        draft_seconds: float = 0.0,
        acceptance: float | None = None,
    ) -> int:
        """The cap on proposals per request (0..max_cap) that maximizes expected tokens per
        second for requests with proposals of these lengths, next to `other_tokens` rows
        of the step that bring no proposal (each of them a decode: one token).
        `draft_seconds`: a draft model's step, one per position up to the longest proposal;
        `acceptance`: instead of the measured one. Before the step times are known: max_cap
        (its steps measure them)."""
        fit = self.step_seconds()
        if fit is None:
            return max_cap
        a, b = fit
        alpha = self.acceptance if acceptance is None else acceptance
        # (by length: a step of 256 decodes has a few distinct ones, and this runs each step)
        requests = Counter(proposal_lengths)
        best, best_rate = 0, -1.0
        for cap in range(max_cap + 1):
            tokens, expected = other_tokens, float(other_tokens)
            for length, count in requests.items():
                m = min(cap, length)
                tokens += count * (1 + m)
                # the first sample always; the next one only if every proposal before it
                # was kept
                expected += count * ((1 - alpha ** (m + 1)) / (1 - alpha) if alpha < 1 else m + 1)
            drafting = draft_seconds * min(cap, max(requests, default=0))
            proposed = any(min(cap, length) for length in requests)
            rate = expected / ((a + b * tokens + drafting) * self.cadence[proposed])
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = cap, rate
        return best
