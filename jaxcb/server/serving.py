"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped JSON or SSE out.

A request's body is read within the size limit (server/request_body.py), its prompts are
tokenized on the tokenizer thread (server/prompts.py), and it becomes a `Submission` (one
engine request per prompt) on the engine loop. The
engine's outputs are cumulative, and a later output's text always extends an earlier one, so
a stream sends `text[len(sent):]` per choice. Choices are numbered `prompt_index * n + j`.
A streaming response whose client goes away aborts its requests at once (the pages are
freed); so does a non-streaming one, which watches for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.engine_loop import EngineLoop
from jaxcb.server.formats import ChatFormat, ChoiceState, CompletionFormat, Format
from jaxcb.server.prompts import ChatPrompt, Prompt, PromptEncoder, prompt_param
from jaxcb.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    error_body,
    parse_body,
)
from jaxcb.server.request_body import read_json_body
from jaxcb.server.submission import EngineFailure, Submission


class OpenAIServing:
    def __init__(
        self,
        engine_loop: EngineLoop,
        encoder: PromptEncoder,
        served_model_names: list[str],
        max_body_bytes: int,
    ) -> None:
        self.engine_loop = engine_loop
        self.encoder = encoder
        self.served_model_names = served_model_names
        self.max_body_bytes = max_body_bytes
        limits = engine_loop.engine.config.limits
        self.max_tokens_cap = limits.max_output_tokens
        self.max_prompts = limits.max_prompts_per_request
        self.tool_call_parser = "hermes"  # --tool-call-parser (app.py sets it)
        # LoRA adapters a request's `model` may name (--lora-modules, /v1/load_lora_adapter)
        self.loras: dict[str, LoRARequest] = {}

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The model a request names (None: the first served name) and the LoRA adapter it
        runs with (None: the base model); 404 for a name the server does not serve."""
        if name is None:
            return self.served_model_names[0], None
        if name in self.loras:
            return name, self.loras[name]
        if name not in self.served_model_names:
            served = [*self.served_model_names, *self.loras]
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{', '.join(map(repr, served))}",
                param="model",
                code="model_not_found",
            )
        return name, None

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = parse_body(await read_json_body(request, self.max_body_bytes), CompletionRequest)
        model, lora = self.resolve_model(body.model)
        params = body.to_sampling_params(self.max_tokens_cap)
        fmt = CompletionFormat(
            "cmpl",
            model,
            params,
            return_token_ids=bool(body.return_token_ids),
            echo=bool(body.echo),
            prompt_only=body.prompt_only,
        )
        return await self._generate(request, fmt, body.prompts(), params, body, arrival, lora)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        raw = await read_json_body(request, self.max_body_bytes)
        body = parse_body(raw, ChatCompletionRequest)
        model, lora = self.resolve_model(body.model)
        params = body.to_sampling_params(self.max_tokens_cap)
        tools = body.tool_mode(self.tool_call_parser)
        offered = [t.template_dict() for t in tools.tools] or None
        prompt = ChatPrompt(body.chat_messages(), tools=offered)
        fmt = ChatFormat(
            "chatcmpl",
            model,
            params,
            return_token_ids=bool(body.return_token_ids),
            tools=tools if tools.tools else None,
        )
        return await self._generate(request, fmt, [prompt], params, body, arrival, lora)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile a constraint here, in a worker thread, off the engine loop (which then
        finds it in the compiler's cache); one the library rejects is a 400."""
        grammars = getattr(self.engine_loop.engine, "grammars", None)
        if params.structured_outputs is None or grammars is None:
            return
        try:
            await asyncio.to_thread(grammars.compile, params.structured_outputs)
        except ValueError as exc:
            raise bad_request(str(exc), "structured_outputs") from None

    async def _generate(
        self,
        request: Request,
        fmt: Format,
        prompts: list[Prompt],
        params: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest,
        arrival: float,
        lora: LoRARequest | None = None,
    ) -> Response:
        if len(prompts) > self.max_prompts:
            raise bad_request(
                f"a request may list at most {self.max_prompts} prompts "
                f"(max_prompts_per_request), got {len(prompts)}",
                "prompt",
            )
        self.engine_loop.check_admission(len(prompts), params.n)  # before the tokenizing
        await self._compile_grammar(params)
        submission = Submission(
            [f"{fmt.id}-{i}" for i in range(len(prompts))],
            final_only=not body.stream,
            want_token_texts=params.logprobs is not None,
        )
        submission.prompt_token_ids = await self.encoder.encode(prompts, params)
        if isinstance(fmt, CompletionFormat) and fmt.want_echo:
            texts = await self.encoder.echo_texts(prompts, submission.prompt_token_ids)
            fmt.set_prompts(texts, submission.prompt_token_ids)
        await self.engine_loop.submit(
            submission,
            params,
            arrival_time=arrival,
            priority=body.priority or 0,
            param=prompt_param(prompts[0]),
            lora_request=lora,
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


async def _stream(submission: Submission, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
    states: dict[int, ChoiceState] = {}
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
                state = states.setdefault(key, ChoiceState())
                if state.finished:
                    continue
                choice = fmt.stream_choice(key, out, sample, state, submission.token_texts)
                if choice is not None:
                    events.append(_sse(fmt.chunk([choice])))
        if events:
            yield "".join(events)
    tail = ""
    if include_usage:
        tail = _sse(fmt.chunk([], usage=fmt.usage(submission, list(latest.values()))))
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
