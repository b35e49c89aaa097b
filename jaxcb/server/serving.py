"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped JSON or SSE out.

A request becomes a `Submission` (one engine request per prompt) on the engine loop. The
engine's outputs are cumulative, and a later output's text always extends an earlier one, so
a stream sends `text[len(sent):]` per choice. Choices are numbered `prompt_index * n + j`.
A streaming response whose client goes away aborts its requests at once (the pages are
freed); so does a non-streaming one, which watches for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.engine_loop import EngineFailure, EngineLoop, Submission
from jaxcb.server.prompts import ChatPrompt, Prompt
from jaxcb.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
)

MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry


class OpenAIServing:
    def __init__(self, engine_loop: EngineLoop, served_model_names: list[str]) -> None:
        self.engine_loop = engine_loop
        self.served_model_names = served_model_names
        self.max_tokens_cap = engine_loop.engine.config.limits.max_output_tokens

    def resolve_model(self, name: str | None) -> str:
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{', '.join(map(repr, self.served_model_names))}",
                param="model",
                code="model_not_found",
            )
        return name

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = parse_body(await request.body(), CompletionRequest)
        model = self.resolve_model(body.model)
        params = body.to_sampling_params(self.max_tokens_cap)
        fmt = _CompletionFormat("cmpl", model, params, return_token_ids=bool(body.return_token_ids))
        return await self._generate(request, fmt, body.prompts(), params, body, arrival)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = parse_body(await request.body(), ChatCompletionRequest)
        model = self.resolve_model(body.model)
        params = body.to_sampling_params(self.max_tokens_cap)
        prompt = ChatPrompt(body.chat_messages())
        fmt = _ChatFormat("chatcmpl", model, params, return_token_ids=bool(body.return_token_ids))
        return await self._generate(request, fmt, [prompt], params, body, arrival)

    async def _generate(
        self,
        request: Request,
        fmt: _Format,
        prompts: list[Prompt],
        params: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest,
        arrival: float,
    ) -> Response:
        submission = Submission(
            [f"{fmt.id}-{i}" for i in range(len(prompts))],
            final_only=not body.stream,
            want_token_texts=params.logprobs is not None,
        )
        await self.engine_loop.submit(
            submission, prompts, params, arrival_time=arrival, priority=body.priority or 0
        )
        if body.stream:
            return _SSEResponse(
                _stream(submission, fmt, include_usage=body.include_usage),
                on_close=lambda: self.engine_loop.abort(submission.request_ids),
            )
        try:
            outputs = await _collect(request, submission, self.engine_loop)
        except _ClientGone:
            return Response(status_code=499)  # nobody is left to read it
        return JSONResponse(fmt.response(outputs, submission))


# ---- streaming and collecting -----------------------------------------------------------


class _ClientGone(Exception):
    pass


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends (done, client
    gone, cancelled), so the requests behind it never outlive it."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _failure_event(message: str) -> str:
    """An error event in OpenAI's shape, then the end of the stream."""
    return _sse(error_body(message, type="server_error")) + "data: [DONE]\n\n"


async def _stream(submission: Submission, fmt: _Format, include_usage: bool) -> AsyncIterator[str]:
    states: dict[int, _ChoiceState] = {}
    latest: dict[int, RequestOutput] = {}
    opening = fmt.opening_chunks(len(submission.request_ids))
    if opening:
        yield "".join(_sse(chunk) for chunk in opening)
    while len(latest) < len(submission.request_ids) or not all(
        out.finished for out in latest.values()
    ):
        try:
            fresh = await submission.updates()
        except EngineFailure as exc:
            yield _failure_event(str(exc))
            return
        events = []
        for index, out in sorted(fresh.items()):
            if out.error is not None:  # the engine failed this request: end the stream
                yield "".join(events) + _failure_event(out.error)
                return
            latest[index] = out
            for sample in out.outputs:
                key = index * fmt.n + sample.index
                state = states.setdefault(key, _ChoiceState())
                if state.finished:
                    continue
                choice = fmt.stream_choice(key, sample, state, submission.token_texts)
                if choice is not None:
                    events.append(_sse(fmt.chunk([choice])))
        if events:
            yield "".join(events)
    tail = ""
    if include_usage:
        tail = _sse(fmt.chunk([], usage=_usage(submission, list(latest.values()))))
    yield tail + "data: [DONE]\n\n"


async def _collect(
    request: Request, submission: Submission, engine_loop: EngineLoop
) -> list[RequestOutput]:
    """Wait for every prompt's final output, or abort if the client disconnects first."""
    results: dict[int, RequestOutput] = {}
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        while len(results) < len(submission.request_ids):
            update = asyncio.ensure_future(submission.updates())
            await asyncio.wait({update, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not update.done():
                update.cancel()
                raise _ClientGone
            try:
                fresh = update.result()
            except EngineFailure as exc:
                raise APIError(500, str(exc), type="server_error") from None
            for out in fresh.values():
                if out.error is not None:
                    raise APIError(500, f"the request failed: {out.error}", type="server_error")
            results.update((i, out) for i, out in fresh.items() if out.finished)
        return [results[i] for i in range(len(submission.request_ids))]
    finally:
        disconnected.cancel()
        if len(results) < len(submission.request_ids):
            engine_loop.abort(submission.request_ids)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(submission: Submission, outputs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for ids in submission.prompt_token_ids)
    completion_tokens = sum(len(s.token_ids) for out in outputs for s in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---- response shapes --------------------------------------------------------------------


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    finished: bool = False


class _Format:
    """The JSON shapes of one endpoint; subclasses fill in the per-choice parts."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, prefix: str, model: str, params: SamplingParams, *, return_token_ids: bool
    ) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = params.n
        self.want_logprobs = params.logprobs is not None
        self.return_token_ids = return_token_ids

    def opening_chunks(self, num_prompts: int) -> list[dict[str, Any]]:
        return []

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def response(self, outputs: list[RequestOutput], submission: Submission) -> dict[str, Any]:
        token_texts = submission.token_texts
        choices = []
        for index, out in enumerate(outputs):
            for sample in out.outputs:
                key = index * self.n + sample.index
                choice = self.final_choice(key, sample, token_texts)
                if self.return_token_ids:
                    choice["token_ids"] = list(sample.token_ids)
                choices.append(choice)
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(submission, outputs),
        }

    def stream_choice(
        self,
        key: int,
        sample: CompletionOutput,
        state: _ChoiceState,
        token_texts: dict[int, str],
    ) -> dict[str, Any] | None:
        """The next chunk's choice for `sample`, or None if there is nothing new to send."""
        delta = sample.text[state.num_chars :]
        start, end = state.num_tokens, len(sample.token_ids)
        per_token = (self.want_logprobs or self.return_token_ids) and end > start
        if not delta and sample.finish_reason is None and not per_token:
            return None
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs(sample, start, end, token_texts, state)
        choice = self.delta_choice(key, delta, logprobs, sample.finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(sample.token_ids[start:end])
        state.num_chars = len(sample.text)
        state.num_tokens = end
        state.finished = sample.finish_reason is not None
        return choice

    def final_choice(
        self, key: int, sample: CompletionOutput, token_texts: dict[int, str]
    ) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs(sample, 0, len(sample.token_ids), token_texts, _ChoiceState())
        return self.full_choice(key, sample.text, logprobs, sample.finish_reason)

    # per endpoint
    def delta_choice(
        self, key: int, delta: str, logprobs: Any, finish_reason: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def full_choice(
        self, key: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs(
        self,
        sample: CompletionOutput,
        start: int,
        end: int,
        token_texts: dict[int, str],
        state: _ChoiceState,
    ) -> Any:
        raise NotImplementedError


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _top(sample: CompletionOutput, i: int) -> dict[int, float]:
    tops = sample.top_logprobs or []
    return tops[i] if i < len(tops) else {}


class _CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def delta_choice(self, key, delta, logprobs, finish_reason):
        return {"index": key, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def full_choice(self, key, text, logprobs, finish_reason):
        return {"index": key, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, sample, start, end, token_texts, state):
        ids = sample.token_ids[start:end]
        tokens = [token_texts.get(t, "") for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in (sample.logprobs or [])[start:end]],
            "top_logprobs": [
                {token_texts.get(t, ""): _finite(lp) for t, lp in _top(sample, i).items()}
                for i in range(start, end)
            ],
            "text_offset": offsets,
        }


class _ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_chunks(self, num_prompts: int) -> list[dict[str, Any]]:
        # OpenAI's streams open with the role, one chunk per choice.
        return [
            self.chunk(
                [
                    {
                        "index": key,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for key in range(num_prompts * self.n)
        ]

    def delta_choice(self, key, delta, logprobs, finish_reason):
        return {
            "index": key,
            "delta": {"content": delta} if delta else {},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def full_choice(self, key, text, logprobs, finish_reason):
        return {
            "index": key,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def logprobs(self, sample, start, end, token_texts, state):
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_texts.get(token_id, "")
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        content = []
        chosen = sample.logprobs or []
        for i in range(start, min(end, len(chosen))):
            item = entry(sample.token_ids[i], chosen[i])
            item["top_logprobs"] = [entry(t, lp) for t, lp in _top(sample, i).items()]
            content.append(item)
        return {"content": content}
