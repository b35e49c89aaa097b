"""The interface a speculative proposer implements (speculator.build_proposer builds them).

A proposer guesses the tokens that follow a decoding request's tokens. It is asked once a
step per decoding request, with the most it may propose; what it returns is verified by
the target model in the next step, so a bad guess costs only the step's extra rows, never
a wrong token. It keeps what it needs between steps in `request.proposer_state` (created on
its first call; a request preempted and recomputed keeps its tokens, so the state stays
valid), and sees nothing of the scheduler or the device.
"""

from __future__ import annotations

import abc

from jaxcb.engine.request import Request


class Proposer(abc.ABC):
    """Guesses the next tokens of a request (see the module docstring)."""

    @abc.abstractmethod
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """At most `max_tokens` (>= 1) tokens that may follow `request.token_ids`; [] when
        it has no guess."""
