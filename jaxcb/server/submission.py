"""What travels between an HTTP handler and the engine thread for one request.

A `Submission` is the handler's side: one mailbox for all the engine requests of an HTTP
request (one per prompt). A `Route` is the engine thread's side of one engine request: which
submission and prompt it answers, and what of it the metrics and the token texts have seen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxcb.outputs import RequestOutput
from jaxcb.server.metrics import ServerMetrics


class EngineFailure(Exception):
    """The engine failed while a request was in flight; the request is gone."""


class Submission:
    """One HTTP request: an engine request per prompt, all answering through one mailbox.

    The engine thread posts cumulative outputs. A post replaces the not-yet-taken output of
    the same prompt, so a slow client holds at most one output per prompt instead of a
    growing backlog, and loses nothing: a later output holds all an earlier one did. With
    `final_only`, only finished outputs are posted.
    """

    def __init__(
        self,
        request_ids: Sequence[str],
        *,
        final_only: bool = False,
        want_token_texts: bool = False,
    ) -> None:
        self.request_ids = list(request_ids)
        self.final_only = final_only
        self.want_token_texts = want_token_texts  # logprobs need each token's text
        self.prompt_token_ids: list[list[int]] = []  # the prompts, tokenized
        self.token_texts: dict[int, str] = {}  # token id -> text, gathered from the outputs
        self._pending: dict[int, RequestOutput] = {}
        self._failure: EngineFailure | None = None
        self._ready = asyncio.Event()

    async def updates(self) -> dict[int, RequestOutput]:
        """Wait for news: {prompt index: its latest output}. Raises EngineFailure."""
        await self._ready.wait()
        self._ready.clear()
        if self._failure is not None:
            raise self._failure
        pending, self._pending = self._pending, {}
        return pending

    def _post(self, index: int, out: RequestOutput | EngineFailure) -> None:
        """On the event loop thread."""
        if isinstance(out, EngineFailure):
            self._failure = out
        else:
            self._pending[index] = out
            self.token_texts.update(out.extra.get("token_texts", {}))
        self._ready.set()


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    """Answer a handler's add: accepted (None) or refused; on the event loop."""
    if future.done():  # the handler was cancelled; its abort is already queued
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def post_all(batch: list[tuple[Submission, int, Any]]) -> None:
    """Deliver (submission, prompt index, output or failure) items; on the event loop."""
    for submission, index, item in batch:
        submission._post(index, item)


@dataclass(eq=False)
class Route:
    """Engine-thread bookkeeping of one engine request."""

    submission: Submission
    index: int  # which prompt of the submission
    arrival_time: float
    num_tokens: list[int]  # tokens already counted in the metrics, per sample
    last_token_time: list[float]
    num_text_tokens: list[int]  # tokens whose texts were already sent, per sample
    got_first_token: bool = False
    sent_prompt_texts: bool = False  # the prompt tokens' texts (for echo's logprobs)

    @classmethod
    def new(cls, submission: Submission, index: int, arrival_time: float, n: int) -> Route:
        return cls(submission, index, arrival_time, [0] * n, [arrival_time] * n, [0] * n)

    def observe(self, out: RequestOutput, now: float, metrics: ServerMetrics) -> None:
        """Metrics for what is new in `out`."""
        for j, sample in enumerate(out.outputs):
            seen, total = self.num_tokens[j], len(sample.token_ids)
            if total <= seen:
                continue
            new = total - seen
            metrics.generation_tokens.inc(new)
            if not self.got_first_token:
                self.got_first_token = True
                metrics.time_to_first_token.observe(now - self.arrival_time)
            elif seen:
                gap = (now - self.last_token_time[j]) / new
                for _ in range(new):
                    metrics.inter_token_latency.observe(gap)
            self.num_tokens[j] = total
            self.last_token_time[j] = now
        if out.finished:
            reasons = [s.finish_reason or "abort" for s in out.outputs]
            for reason in reasons:
                metrics.request_finished(reason)
            if "abort" not in reasons:
                metrics.e2e_request_latency.observe(now - self.arrival_time)
                if out.metrics is not None:
                    tokens = max(len(s.token_ids) for s in out.outputs)
                    metrics.request_phases(out.metrics, tokens)

    def attach_token_texts(self, out: RequestOutput, token_text: Callable[[int], str]) -> None:
        """Put the text of each token not yet sent into `out.extra` (for logprobs)."""
        if not self.submission.want_token_texts:
            return
        texts: dict[int, str] = {}
        for j, sample in enumerate(out.outputs):
            start = self.num_text_tokens[j]
            for token_id in sample.token_ids[start:]:
                texts[token_id] = token_text(token_id)
            for top in (sample.top_logprobs or [])[start:]:
                for token_id in top:
                    texts[token_id] = token_text(token_id)
            self.num_text_tokens[j] = len(sample.token_ids)
        if out.prompt_logprobs is not None and not self.sent_prompt_texts:
            for token_id in out.prompt_token_ids:
                texts[token_id] = token_text(token_id)
            for entry in out.prompt_logprobs:
                for token_id in entry or ():
                    texts[token_id] = token_text(token_id)
            self.sent_prompt_texts = True
        out.extra["token_texts"] = texts


class TokenTexts:
    """token id -> its text, with the engine's tokenizer (on the engine thread), cached."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text
