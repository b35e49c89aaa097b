"""The interface a speculative proposer implements (speculator.build_proposer builds them).

A proposer guesses the tokens that follow a decoding request's tokens. It is asked once a
step per decoding request, with the most it may propose; what it returns is verified by
the target model in the next step, so a bad guess costs only the step's extra rows, never
a wrong token. It keeps what it needs between steps in `request.proposer_state` (created on
its first call; a request preempted and recomputed keeps its tokens, so the state stays
valid), or, for what lives elsewhere (a draft model's KV pages), drops it for requests no
longer running (`retain`). It sees nothing of the scheduler or the target's device state.
Two implement it: ngram.py (prompt lookup) and draft.py (a draft model).
"""

from __future__ import annotations

import abc

from jaxcb.engine.request import Request


class Proposer(abc.ABC):
    """Guesses the next tokens of a request (see the module docstring)."""

    #: Its guesses cost steps of a model (a draft model), one per guessed position: the
    #: Speculator then decides how many to ask for before asking.
    runs_a_model = False

    @property
    def seconds_per_guess(self) -> float:
        """What one more guessed position costs the step (a draft model's step); 0.0 for
        guesses that cost no model."""
        return 0.0

    @abc.abstractmethod
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """At most `max_tokens` (>= 1) tokens that may follow `request.token_ids`; [] when
        it has no guess."""

    def propose_batch(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        """`propose` for several requests at once (a draft model guesses for all of them in
        the same steps)."""
        return [self.propose(r, n) for r, n in zip(requests, max_tokens, strict=True)]

    def retain(self, running: list[Request]) -> None:  # noqa: B027 (optional hook)
        """Only these requests are running now: state kept elsewhere than in
        `request.proposer_state` (a draft model's KV pages) may be dropped for the others."""
