"""Each step's proposals: the Speculator asks the proposer for every decoding request's
guesses before the scheduler runs, within the request's limits and the cap SpeculationCost
finds worth it, and feeds the cost model what each step measured afterwards.

A request gets no proposals while it is constrained by a grammar (its mask after a proposal
would need the grammar advanced past it) or when one more token ends it.
"""

from __future__ import annotations

import time

from jaxcb.config import SpeculativeConfig
from jaxcb.engine.request import Request
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.engine.spec.cost import SpeculationCost
from jaxcb.engine.spec.draft import DraftModel, DraftModelProposer
from jaxcb.engine.spec.ngram import NgramProposer
from jaxcb.engine.spec.proposer import Proposer

#: While proposals are turned down, one request's are verified every this many steps, so
#: that the acceptance the turn-down decides by stays measured (the step waits for the one
#: in flight first: proposals follow its tokens). A draft model's exploring step costs its
#: catch-up and guesses as well: every EXPLORE_EVERY_DRAFT-th step.
EXPLORE_EVERY = 8
EXPLORE_EVERY_DRAFT = 64


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.cost = SpeculationCost()
        self.last_cap = config.num_speculative_tokens  # the cap of the last step's proposals
        self._turned_down_steps = 0  # steps wants_proposals found proposals would not pay
        self._explore_next = False
        self._last_observed: float | None = None  # when the last step was observed
        self.explore_every = EXPLORE_EVERY_DRAFT if proposer.runs_a_model else EXPLORE_EVERY

    @classmethod
    def build(
        cls, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None
    ) -> Speculator | None:
        proposer = build_proposer(config, draft)
        return None if proposer is None else cls(config, proposer, max_model_len)

    def wants_proposals(self, running: list[Request]) -> bool:
        """Whether this step should propose: some request decodes and proposals of full
        length could pay at the acceptance measured so far; or, while they could not but
        would if every proposal were kept, every `explore_every`-th step (one request's
        proposal is verified then, so that the acceptance stays measured). An async engine
        waits for the step in flight only when this is true: proposals follow its tokens."""
        decodes = sum(r.is_decoding and r.grammar is None for r in running)
        if not decodes:
            return False
        k, draft = self.config.num_speculative_tokens, self.proposer.seconds_per_guess
        if self.cost.best_cap([k] * decodes, 0, k, draft) > 0:
            self._explore_next = False
            return True
        self._turned_down_steps += 1
        # (no exploring while even proposals that are always kept would not pay)
        could_pay = self.cost.best_cap([k] * decodes, 0, k, draft, acceptance=1.0) > 0
        self._explore_next = could_pay and self._turned_down_steps % self.explore_every == 0
        return self._explore_next

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` of every running request for the next step ([] for those
        not decoding, or without a guess, or when proposals do not pay now). Their tokens
        must all be on the host. (What the proposer keeps for requests no longer running
        was dropped when the last step was observed.)"""
        k = self.config.num_speculative_tokens
        candidates: list[tuple[Request, int]] = []
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
                candidates.append((request, room))
        if not candidates:
            return
        others = sum(r.is_decoding for r in running) - len(candidates)
        if self.proposer.runs_a_model:
            # Each guessed position costs a draft step: the cap comes first, as if every
            # guess were full length, and the draft guesses that many.
            self.last_cap = self.cost.best_cap(
                [room for _, room in candidates], others, k, self.proposer.seconds_per_guess
            )
            if self.last_cap == 0:
                if not self._explore_next:
                    return
                candidates = [max(candidates, key=lambda c: c[1])]  # (see wants_proposals)
            caps = [min(room, self.last_cap or room) for _, room in candidates]
            requests = [r for r, _ in candidates]
            for request, proposal in zip(
                requests, self.proposer.propose_batch(requests, caps), strict=True
            ):
                request.draft_token_ids = proposal
            return
        proposals = self.proposer.propose_batch(
            [r for r, _ in candidates], [room for _, room in candidates]
        )
        self.last_cap = self.cost.best_cap([len(p) for p in proposals], others, k)
        for (request, _), proposal in zip(candidates, proposals, strict=True):
            request.draft_token_ids = proposal[: self.last_cap]
        if self.last_cap == 0 and any(proposals) and self._explore_next:
            # (turned down: one request's proposal still verified, see wants_proposals)
            (request, _), proposal = max(
                zip(candidates, proposals, strict=True), key=lambda cp: len(cp[1])
            )
            request.draft_token_ids = proposal

    @staticmethod
    def clear(running: list[Request]) -> None:
        """No proposals this step."""
        for request in running:
            request.draft_token_ids = []

    def observe(
        self, sched: SchedulerOutput, device_seconds: float | None, running: list[Request]
    ) -> None:
        """What a step measured: how many of each request's proposals were kept (set by
        OutputProcessor.append_verified), and its tokens and seconds when those are the
        device's alone (None: another step overlapped it). `running`: the requests still
        running after it (the proposer drops what it keeps for the others)."""
        self.proposer.retain(running)
        now = time.perf_counter()
        if self._last_observed is not None:  # (a step's wall seconds: one observe to the next)
            positions = max((c.num_draft_tokens for c in sched.chunks), default=0)
            draft = self.proposer.seconds_per_guess * positions
            self.cost.observe_cadence(
                sched.num_tokens, draft, positions > 0, now - self._last_observed
            )
        self._last_observed = now if running else None
        if device_seconds is not None:
            self.cost.observe_step(sched.num_tokens, device_seconds)
        for chunk in sched.chunks:
            if chunk.draft_token_ids:
                self.cost.observe_verified(chunk.num_draft_tokens, chunk.num_accepted_drafts)


def build_proposer(config: SpeculativeConfig, draft: DraftModel | None = None) -> Proposer | None:
    """The proposer `config.method` names (the one place a method is chosen); None when
    speculation is off. `draft`: the draft model the factory built for "draft_model"."""
    if config.method == "none":
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        if draft is None:
            raise ValueError("speculative method 'draft_model' needs its draft model built")
        return DraftModelProposer(draft)
    raise ValueError(f"unknown speculative method {config.method!r}")
