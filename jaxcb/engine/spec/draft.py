"""Draft-model proposals: a second, cheaper model guesses the next tokens greedily, one
token a step, over KV pages of its own, and the target model verifies them.

The draft is a Runner like the target's (built by the factory: the target's checkpoint in a
cheaper form, e.g. its int8 / 4-bit CPU path, or a smaller model with the same tokenizer).
Each decoding request has a `DraftSequence` here: the tokens the draft has seen, how many of
them have K/V in its pages, and those pages (from its own PagePool). Before a step it is
brought up to the request's tokens: positions where the target kept the draft's guesses
keep their K/V; from the first token that differs on, the draft computes again. So a step
of the draft feeds each request the tokens the target added since (one or two when the
guesses were kept, the whole prompt the first time) and samples its first guess; each next
step feeds the guess before and samples the next. The draft guesses greedily: a proposal
is then a single token with probability 1, which the target's sample-and-compare check
(OutputProcessor.append_verified) keeps with exactly the probability the rejection rule
min(1, p/q) gives, so the output is the target's whatever the draft.

A request's draft state is dropped (its pages freed) once the request is no longer running
(finished, aborted or preempted: it catches up again when it decodes again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxcb.engine.buckets import Bucket, pick_bucket
from jaxcb.engine.interface import Runner
from jaxcb.engine.request import Request
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.schedule import ScheduledChunk, SchedulerOutput
from jaxcb.engine.spec.proposer import Proposer
from jaxcb.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
GUESS_DECAY = 0.9  # weight the past keeps in the mean seconds of a guessed position


@dataclass(frozen=True)
class DraftModel:
    """The draft's device side as the engine sees it (the factory builds it)."""

    runner: Runner
    buckets: tuple[Bucket, ...]
    page_size: int
    num_pages: int


class DraftSequence:
    """One request as the draft sees it: a Request of its own (the draft runner packs it
    like any other), whose `token_ids` are the target's tokens the draft was last given
    and the guesses fed after them, `num_computed_tokens` those with K/V in the draft's
    pages, `page_ids` those pages."""

    def __init__(self, request_id: str) -> None:
        self.request = Request(
            request_id=request_id,
            prompt_token_ids=[],
            params=GREEDY,
            seed=0,
            max_tokens=1 << 30,
            eos_token_ids=frozenset(),
            arrival_time=0.0,
        )
        self.num_given = 0  # token_ids[:num_given] are the target's; the rest are guesses

    def follow(self, target_tokens: list[int]) -> None:
        """Take the target's tokens; K/V stays for the positions whose tokens are unchanged
        (the guesses the target kept, and everything before them)."""
        seq = self.request
        same = self.num_given
        limit = min(len(seq.token_ids), len(target_tokens))
        while same < limit and seq.token_ids[same] == target_tokens[same]:
            same += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, same)
        # (only what changed: copying the whole context every step would cost its length)
        del seq.token_ids[same:]
        seq.token_ids.extend(target_tokens[same:])
        self.num_given = len(target_tokens)


class DraftModelProposer(Proposer):
    """Greedy guesses from a draft model (see the module docstring)."""

    runs_a_model = True

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self.pool = PagePool(draft.num_pages)
        self.max_tokens_per_step = max(b.num_tokens for b in draft.buckets)
        self.max_seqs_per_step = max(b.num_seqs for b in draft.buckets)
        self.sequences: dict[str, DraftSequence] = {}
        self.num_steps = 0  # draft steps run (for stats and tests)
        self._guess_seconds = 0.0  # decayed mean seconds of a guessed position
        self._last_catch_up = 0  # the most tokens a sequence fed in the last catch-up

    # ---- Proposer ------------------------------------------------------------------------

    @property
    def seconds_per_guess(self) -> float:
        return self._guess_seconds

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return self.propose_batch([request], [max_tokens])[0]

    def retain(self, running: list[Request]) -> None:
        live = {r.request_id for r in running}
        for request_id in [i for i in self.sequences if i not in live]:
            self._drop(request_id)

    def propose_batch(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        t0 = time.perf_counter()
        out = self._propose_batch(requests, max_tokens)
        # What a guessed position costs: these steps' seconds (packing, the draft's steps,
        # its catch-up) over the positions; not when a catch-up was a prompt's prefill.
        positions = max(map(len, out), default=0)
        if positions and self._last_catch_up <= max(max_tokens) + 1:
            seconds = (time.perf_counter() - t0) / positions
            old = self._guess_seconds or seconds
            self._guess_seconds = GUESS_DECAY * old + (1 - GUESS_DECAY) * seconds
        return out

    def _propose_batch(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        proposals: dict[str, list[int]] = {r.request_id: [] for r in requests}
        wanted = {r.request_id: n for r, n in zip(requests, max_tokens, strict=True)}
        active: list[DraftSequence] = []
        for request, n in zip(requests, max_tokens, strict=True):
            if n < 1:
                continue
            seq = self.sequences.get(request.request_id)
            if seq is None:
                seq = self.sequences[request.request_id] = DraftSequence(request.request_id)
            seq.follow(request.token_ids)
            # pages for every position it will feed: its tokens, and the guesses but the last
            if self._reserve(seq.request, len(request.token_ids) + n - 1):
                active.append(seq)
            else:
                self._drop(request.request_id)  # (the pool is full: no guess this step)
        # The first guess: each sequence fed the tokens it has not computed (chunked by the
        # draft's largest bucket), then the next guesses one step each.
        sampled = self._catch_up(active)
        while sampled:
            for seq, token in sampled:
                proposals[seq.request.request_id].append(token)
                seq.request.token_ids.append(token)
            more = [
                seq
                for seq, _ in sampled
                if len(proposals[seq.request.request_id]) < wanted[seq.request.request_id]
            ]
            sampled = self._run([(seq, 1) for seq in more])
        return [proposals[r.request_id] for r in requests]

    # ---- the draft's steps -----------------------------------------------------------------

    def _catch_up(self, seqs: list[DraftSequence]) -> list[tuple[DraftSequence, int]]:
        """Feed every sequence its tokens without K/V; each one's first guess."""
        sampled: list[tuple[DraftSequence, int]] = []
        self._last_catch_up = max((s.request.num_uncomputed_tokens for s in seqs), default=0)
        pending = list(seqs)
        while pending:
            step: list[tuple[DraftSequence, int]] = []
            room = self.max_tokens_per_step
            for seq in pending:
                if room == 0 or len(step) == self.max_seqs_per_step:
                    break
                n = min(room, seq.request.num_uncomputed_tokens)
                step.append((seq, n))
                room -= n
            sampled += self._run(step)
            pending = [s for s in pending if s.request.num_uncomputed_tokens > 0]
        return sampled

    def _run(self, feeds: list[tuple[DraftSequence, int]]) -> list[tuple[DraftSequence, int]]:
        """Draft steps feeding each sequence its next `n` tokens (as many steps as the
        largest bucket needs); the token sampled after each sequence that reached its end."""
        sampled: list[tuple[DraftSequence, int]] = []
        while feeds:
            step, room = [], self.max_tokens_per_step
            while feeds and len(step) < self.max_seqs_per_step and feeds[0][1] <= room:
                step.append(feeds.pop(0))
                room -= step[-1][1]
            sched = SchedulerOutput(
                chunks=[
                    ScheduledChunk(seq.request, seq.request.num_computed_tokens, n)
                    for seq, n in step
                ]
            )
            bucket = pick_bucket(self.draft.buckets, sched.num_tokens, len(step))
            runner = self.draft.runner
            result = runner.execute(bucket, runner.prepare(sched, bucket))
            self.num_steps += 1
            for row, (chunk, (seq, _)) in enumerate(zip(sched.chunks, step, strict=True)):
                samples = chunk.samples
                seq.request.num_computed_tokens = chunk.end
                if samples:
                    sampled.append((seq, int(result.token_ids[row])))
        return sampled

    # ---- pages ---------------------------------------------------------------------------

    def _reserve(self, seq: Request, num_tokens: int) -> bool:
        """Pages for positions [0, num_tokens) of `seq`; False if the pool has too few."""
        needed = -(-num_tokens // self.draft.page_size) - len(seq.page_ids)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        seq.page_ids += self.pool.allocate(needed)
        return True

    def _drop(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.pool.free(seq.request.page_ids)
            seq.request.page_ids = []
