"""Speculative decoding on the host: proposers guess a decoding request's next tokens, the
speculator hands them to the scheduler each step and learns whether they pay.

    proposer.py    the Proposer interface (what a new method implements)
    ngram.py       prompt lookup: the continuation of the suffix's latest earlier occurrence
    draft.py       a draft model's greedy guesses, over its own runner and KV pages
    speculator.py  the factory of proposers; each step's proposals, capped by the requests'
                   limits and by SpeculationCost (cost.py): measured step times, acceptance

The target model verifies the proposals inside the ordinary step (runtime/step_input.py
gives each proposal a sampling row); OutputProcessor.append_verified keeps those the samples
confirm. Pure Python: no jax.
"""

from jaxcb.engine.spec.draft import DraftModel
from jaxcb.engine.spec.proposer import Proposer
from jaxcb.engine.spec.speculator import Speculator, build_proposer

__all__ = ["DraftModel", "Proposer", "Speculator", "build_proposer"]
