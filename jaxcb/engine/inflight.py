"""Async scheduling's bookkeeping: the step in flight, and the links into it.

With `scheduler.async_scheduling`, LLMEngine schedules, packs and dispatches step N+1 before
it reads step N's sampled tokens back (as vLLM's async scheduling), so the host's work hides
behind the device's. What makes that give the same tokens:

- A token a dispatched step is sampling counts in its request's `num_tokens`
  (`Request.num_inflight`) from dispatch to read-back, so step N+1 schedules the request's
  decode as if the token were there; its chunk's `prev_sample_row` names the token's row in
  step N, and the device takes the input from step N's output (runtime/step.py).
- A seeded draw folds in the number of tokens generated before it: the packer counts the
  tokens in flight too (runtime/step_input.py).
- A request whose tokens in flight reach max_tokens is not scheduled again. One that stops
  on step N's token (EOS, stop token or string) may already be in step N+1: that token is
  dropped when read back (the request has finished), step N+1's pages are not registered in
  the prefix cache for it, and its pages are freed as soon as it stops.
- Pages freed while a step that writes them is in flight (a stop, an abort, a preemption)
  may go to another request at once: every later step that uses them consumes the KV state
  the step in flight outputs, so the device runs it first.
- Rows with penalties read their history on the host, and constrained rows (structured
  outputs) need their last token in the grammar before the next mask: a step after one that
  sampled such a row waits for its tokens first (`needs_host_tokens`). So does a step after
  one that verified proposals (speculative decoding: how many tokens it brings is known
  only then), and a step that proposes (proposals follow the newest tokens): speculation
  runs synchronously while it proposes, and overlaps while it is turned down.

Engines that cannot overlap run synchronously (`sync_reason`).

Pure Python: no jax.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket
from jaxcb.engine.interface import Runner, StepResult
from jaxcb.engine.sched.schedule import SchedulerOutput


@dataclass
class InFlightStep:
    """A dispatched step whose tokens the host has not read back."""

    sched: SchedulerOutput
    bucket: Bucket
    handle: Any  # the runner's dispatch handle
    samples: list[bool]  # per chunk: the step samples its request's next token
    # a sampled row has penalties or a grammar, or proposals (how many tokens it brings is
    # known once read back): the next step waits
    needs_host_tokens: bool
    # when it was dispatched, and whether no other step was in flight then (its dispatch
    # to its tokens is then the device's time for it, if none is dispatched after it)
    dispatched_at: float = 0.0
    alone: bool = False

    @classmethod
    def dispatch(
        cls, runner: Runner, sched: SchedulerOutput, bucket: Bucket, prepared: Any, *, alone: bool
    ) -> InFlightStep:
        """Start the step; its sampled tokens count as in flight until `collect`. `alone`:
        no other step is in flight."""
        samples = [c.samples for c in sched.chunks]  # (asked before the tokens count)
        dispatched_at = time.perf_counter()
        handle = runner.dispatch(bucket, prepared)
        needs_host_tokens = False
        for chunk, sampled in zip(sched.chunks, samples, strict=True):
            if sampled:
                chunk.request.num_inflight += 1
                # penalties read the history, a grammar's mask follows the last token
                req = chunk.request
                needs_host_tokens |= req.params.uses_penalties or req.grammar is not None
                needs_host_tokens |= bool(chunk.draft_token_ids)
        return cls(sched, bucket, handle, samples, needs_host_tokens, dispatched_at, alone)

    def collect(self, runner: Runner) -> StepResult:
        """Wait for the step's results; its tokens are no longer in flight (the caller
        appends them, or drops those of requests that finished meanwhile)."""
        result = runner.collect(self.handle)
        for chunk, sampled in zip(self.sched.chunks, self.samples, strict=True):
            if sampled:
                chunk.request.num_inflight -= 1
        return result

    @property
    def all_finished(self) -> bool:
        """Every request in it has finished (or aborted): its tokens will all be dropped."""
        return all(c.request.finished for c in self.sched.chunks)


def link_to_inflight(sched: SchedulerOutput, pending: InFlightStep | None) -> None:
    """Point each chunk whose last input token `pending` is sampling at that token's row."""
    if pending is None:
        return
    rows = {
        id(c.request): s
        for s, (c, sampled) in enumerate(zip(pending.sched.chunks, pending.samples, strict=True))
        if sampled
    }
    for chunk in sched.chunks:
        row = rows.get(id(chunk.request))
        if row is not None:
            # (a request with a token in flight is decoding: the token is its chunk's last)
            chunk.prev_sample_row = row


def sync_reason(config: EngineConfig, runner: Runner, *, swap: bool, itl: bool) -> str | None:
    """Why an engine with `async_scheduling` must still run synchronously (None: it can
    overlap)."""
    sched = config.scheduler
    if sched.batching != "continuous":
        return f"batching={sched.batching!r}: the padded-batch baselines run synchronously"
    if swap:
        return (
            f"preemption_mode={sched.preemption_mode!r}: swap copies and their cost model "
            "work between steps"
        )
    if itl:
        return "itl_target_ms: the ITL controller times each step from schedule to tokens"
    if not (hasattr(runner, "dispatch") and hasattr(runner, "collect")):
        return f"{type(runner).__name__} has no dispatch/collect"
    return None
