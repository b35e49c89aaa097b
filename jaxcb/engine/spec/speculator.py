"""Each step's proposals: the Speculator asks the proposer for every decoding request's
guesses before the scheduler runs, within the request's limits and the cap SpeculationCost
finds worth it, and feeds the cost model what each step measured afterwards.

A request gets no proposals while it is constrained by a grammar (its mask after a proposal
would need the grammar advanced past it) or when one more token ends it.
"""

from __future__ import annotations

from jaxcb.config import SpeculativeConfig
from jaxcb.engine.request import Request
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.engine.spec.cost import SpeculationCost
from jaxcb.engine.spec.ngram import NgramProposer
from jaxcb.engine.spec.proposer import Proposer

#: While proposals are turned down, one request's are verified every this many steps, so
#: that the acceptance the turn-down decides by stays measured.
EXPLORE_EVERY = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.cost = SpeculationCost()
        self.last_cap = config.num_speculative_tokens  # the cap of the last step's proposals
        self._turned_down_steps = 0

    @classmethod
    def build(cls, config: SpeculativeConfig, max_model_len: int) -> Speculator | None:
        proposer = build_proposer(config)
        return None if proposer is None else cls(config, proposer, max_model_len)

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` of every running request for the next step ([] for those
        not decoding, or without a guess, or when proposals do not pay now)."""
        k = self.config.num_speculative_tokens
        proposals: list[tuple[Request, list[int]]] = []
        for request in running:
            request.draft_token_ids = []
            if not request.is_decoding or request.grammar is not None:
                continue
            room = min(
                k,
                request.max_tokens - len(request.output_token_ids) - 1,
                self.max_model_len - request.num_tokens,
            )
            if room > 0:
                proposals.append((request, self.proposer.propose(request, room)))
        if not proposals:
            return
        lengths = [len(p) for _, p in proposals]
        decodes = sum(r.is_decoding for r in running)
        self.last_cap = self.cost.best_cap(lengths, decodes - len(proposals), k)
        for request, proposal in proposals:
            request.draft_token_ids = proposal[: self.last_cap]
        if self.last_cap == 0 and any(lengths):
            # Turned down: the acceptance stops being measured, so every EXPLORE_EVERY
            # such steps one request's proposal is still verified (a few rows).
            self._turned_down_steps += 1
            if self._turned_down_steps % EXPLORE_EVERY == 0:
                request, proposal = max(proposals, key=lambda rp: len(rp[1]))
                request.draft_token_ids = proposal

    def observe(self, sched: SchedulerOutput, device_seconds: float) -> None:
        """What a synchronous step measured: its tokens and seconds, and how many of each
        request's proposals were kept (set by OutputProcessor.append_verified)."""
        self.cost.observe_step(sched.num_tokens, device_seconds)
        for chunk in sched.chunks:
            if chunk.draft_token_ids:
                self.cost.observe_verified(chunk.num_draft_tokens, chunk.num_accepted_drafts)


def build_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer `config.method` names (the one place a method is chosen); None when
    speculation is off."""
    if config.method == "none":
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.method!r}")
