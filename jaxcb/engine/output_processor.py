"""What the engine does with a step's tokens once they are back on the host.

OutputProcessor keeps the engine's user requests by id (each a RequestGroup: its n samples
and their detokenizers) from add_request until they finish, and applies each step's result
to them: every sampled token appended with its logprobs, detokenized, checked against the
stop strings, EOS, stop tokens and the length limits; a request that stops is finished in
the scheduler (its pages freed); the RequestOutputs of the groups that got a token or
finished are built.

Fault isolation: an exception while handling one request's token (detokenizer, stop strings,
output building) fails that request alone: finish_reason "error", the message in
`RequestOutput.error`, its pages freed; every other request goes on.

Pure Python: no jax.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from jaxcb.engine.groups import RequestGroup
from jaxcb.engine.interface import StepResult
from jaxcb.engine.logprobs import append_sample_logprobs, record_prompt_logprobs
from jaxcb.engine.request import Request
from jaxcb.engine.sched.base import BaseScheduler
from jaxcb.engine.sched.schedule import SchedulerOutput, sample_row_starts
from jaxcb.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OutputProcessor:
    """The engine's requests by id, and a step's tokens applied to them (module docstring)."""

    def __init__(
        self, scheduler: BaseScheduler, counts: Counter[str], *, max_model_len: int
    ) -> None:
        """`counts`: the engine's counters (this adds generated_tokens and failed)."""
        self.scheduler = scheduler
        self.counts = counts
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}  # request id -> group, until it finishes
        self._group_of: dict[int, RequestGroup] = {}  # id(child) -> its group

    def add(self, group: RequestGroup) -> None:
        """Track a new request's group (its id must not be in use)."""
        self.groups[group.request_id] = group
        for child in group.children:
            self._group_of[id(child)] = group

    def process(
        self, sched: SchedulerOutput, result: StepResult, samples: list[bool]
    ) -> list[RequestOutput]:
        """Apply a step's tokens; `samples`: per chunk, whether the step sampled for it
        (ScheduledChunk.samples, asked before the step ran). Returns the outputs of the
        groups that got a token, or finished (a `final_only` group: only then)."""
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        record_prompt_logprobs(sched.chunks, result)
        rows = sample_row_starts(sched.chunks)
        for s, chunk in enumerate(sched.chunks):
            req = chunk.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if not samples[s] or req.finished:
                continue  # (finished: it stopped on the previous step's token, or aborted)
            group = self._group_of[id(req)]
            touched[group.request_id] = group
            try:
                if chunk.draft_token_ids:
                    chunk.num_accepted_drafts = self.append_verified(
                        req, group, result, rows[s], chunk.draft_token_ids, now
                    )
                else:
                    self.append_sample(req, group, result, rows[s], now)
            except Exception as exc:  # this request's problem only: the others go on
                self.fail(req, exc, now)
        return [self.output(g, now) for g in touched.values() if g.finished or not g.final_only]

    def append_sample(
        self, req: Request, group: RequestGroup, result: StepResult, s: int, now: float
    ) -> None:
        """The token sampled for row s: append it, detokenize, check every stop condition."""
        token = int(result.token_ids[s])
        req.append_token(token)
        append_sample_logprobs(req, result, s)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        self.counts["generated_tokens"] += 1
        detok = group.detokenizer(req)
        stop_str = detok.add_token(token)
        if stop_str is None:
            req.check_stop_tokens(self.max_model_len)
            if req.finish_reason is not None:
                stop_str = detok.flush()  # may complete a stop string too
        if stop_str is not None:  # a stop string beats EOS and length limits
            req.finish_reason, req.stop_reason = "stop", stop_str
        if req.finish_reason is not None:
            req.metrics.finished_time = now
            self.scheduler.finish(req)

    def append_verified(
        self,
        req: Request,
        group: RequestGroup,
        result: StepResult,
        row: int,
        drafts: tuple[int, ...],
        now: float,
    ) -> int:
        """Speculative decoding: rows row.. hold the tokens sampled after the request's
        newest token and after each proposed one. The first is appended; each next one is
        too while the token before it confirmed the proposal fed there (sampled exactly as
        without speculation, from the same key: the same distribution, and the same tokens
        for a seeded or greedy request). The confirmed proposals' K/V, written by the step,
        count as computed; the pages past the request's tokens are freed. Returns how many
        proposals were kept."""
        kept = 0
        for j in range(len(drafts) + 1):
            self.append_sample(req, group, result, row + j, now)
            if req.finished or j == len(drafts) or req.output_token_ids[-1] != drafts[j]:
                break
            kept += 1
        self.counts["spec_drafts"] += 1
        self.counts["spec_draft_tokens"] += len(drafts)
        self.counts["spec_accepted_tokens"] += kept
        if not req.finished:
            req.num_computed_tokens += kept
            self.scheduler.release_unneeded_pages(req)
        return kept

    def fail(self, req: Request, exc: BaseException, now: float) -> None:
        """End one request with finish_reason "error" and free its pages."""
        logger.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
        req.finish_reason, req.stop_reason = "error", None
        req.error = f"{type(exc).__name__}: {exc}"
        req.metrics.finished_time = now
        self.scheduler.finish(req)
        self.counts["failed"] += 1

    def output(self, group: RequestGroup, now: float) -> RequestOutput:
        """The group's output; a finished group is forgotten. If building it fails, the
        group's unfinished requests fail (and its texts are dropped) rather than the loop."""
        try:
            out = group.output()
        except Exception as exc:
            for child in group.children:
                if not child.finished:
                    self.fail(child, exc, now)
                elif child.error is None:
                    child.error = f"{type(exc).__name__}: {exc}"
            group.broken = True
            out = group.output()
        if group.finished:
            self.groups.pop(group.request_id, None)
            for child in group.children:
                self._group_of.pop(id(child), None)
        return out
