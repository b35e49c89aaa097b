"""The JSON shapes of /v1/completions and /v1/chat/completions: whole responses, stream chunks,
choices, logprobs and usage. Choices are numbered `prompt_index * n + j`.

Completions with `echo` put the prompt before the completion (a stream: in each choice's
first chunk), and with `logprobs` the prompt tokens' logprobs before the completion's, the
first token's null, as OpenAI and vLLM do. `echo` with `max_tokens` 0 answers the prompt
alone: the engine generates one token (it samples at the end of the prompt anyway), which
the answer leaves out, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.submission import Submission
from jaxcb.server.tools import ToolCall, ToolMode

MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry


def usage(
    submission: Submission, outputs: list[RequestOutput], *, prompt_only: bool = False
) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for ids in submission.prompt_token_ids)
    completion_tokens = 0
    if not prompt_only:
        completion_tokens = sum(len(s.token_ids) for out in outputs for s in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ChoiceState:
    """What a stream has sent of one choice."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    finished: bool = False
    started: bool = False  # a chunk was sent (an echo goes in the first)
    call_chars: list[int] = dataclasses.field(default_factory=list)  # arguments sent, per call


class Format:
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
        self.prompt_only = False  # completions' echo with max_tokens 0

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
                choice = self.final_choice(key, out, sample, token_texts)
                if self.return_token_ids:
                    choice["token_ids"] = list(self.visible(sample).token_ids)
                choices.append(choice)
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(submission, outputs),
        }

    def usage(self, submission: Submission, outputs: list[RequestOutput]) -> dict[str, int]:
        return usage(submission, outputs, prompt_only=self.prompt_only)

    def visible(self, sample: CompletionOutput) -> CompletionOutput:
        """The sample as the client sees it: without its one token when answering the
        prompt alone (finish_reason "length": max_tokens 0 reached)."""
        if not self.prompt_only:
            return sample
        finish = "length" if sample.finish_reason in ("stop", "length") else sample.finish_reason
        return dataclasses.replace(
            sample, text="", token_ids=[], logprobs=[], top_logprobs=[], finish_reason=finish
        )

    def stream_choice(
        self,
        key: int,
        out: RequestOutput,
        sample: CompletionOutput,
        state: ChoiceState,
        token_texts: dict[int, str],
    ) -> dict[str, Any] | None:
        """The next chunk's choice for `sample` (of `out`), or None if there is nothing new
        to send."""
        sample = self.visible(sample)
        echo = None if state.started else self.echo(key, out, state, token_texts)
        delta = sample.text[state.num_chars :]
        start, end = state.num_tokens, len(sample.token_ids)
        per_token = (self.want_logprobs or self.return_token_ids) and end > start
        if echo is None and not delta and sample.finish_reason is None and not per_token:
            return None
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs(sample, start, end, token_texts, state)
        if echo is not None:
            delta = echo[0] + delta
            logprobs = self.join_logprobs(echo[1], logprobs)
        choice = self.delta_choice(key, delta, logprobs, sample.finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = list(sample.token_ids[start:end])
        state.num_chars = len(sample.text)
        state.num_tokens = end
        state.finished = sample.finish_reason is not None
        state.started = True
        return choice

    def final_choice(
        self,
        key: int,
        out: RequestOutput,
        sample: CompletionOutput,
        token_texts: dict[int, str],
    ) -> dict[str, Any]:
        sample = self.visible(sample)
        state = ChoiceState()
        text, prompt_logprobs = self.echo(key, out, state, token_texts) or ("", None)
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs(sample, 0, len(sample.token_ids), token_texts, state)
            logprobs = self.join_logprobs(prompt_logprobs, logprobs)
        return self.full_choice(key, text + sample.text, logprobs, sample.finish_reason)

    def echo(
        self, key: int, out: RequestOutput, state: ChoiceState, token_texts: dict[int, str]
    ) -> tuple[str, Any] | None:
        """(the prompt's text, its tokens' logprobs or None) to put before a choice's
        completion, or None (no echo: the default)."""
        return None

    def join_logprobs(self, prompt: Any, completion: Any) -> Any:
        return completion

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
        state: ChoiceState,
    ) -> Any:
        raise NotImplementedError


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _top(sample: CompletionOutput, i: int) -> dict[int, float]:
    tops = sample.top_logprobs or []
    return tops[i] if i < len(tops) else {}


class CompletionFormat(Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any, echo: bool = False, prompt_only: bool = False, **kw: Any):
        """`echo`: the prompts come first (`set_prompts` gives them); `prompt_only`: and
        nothing else (echo with max_tokens 0)."""
        super().__init__(*args, **kw)
        self.want_echo = echo
        self.prompt_only = prompt_only
        self.prompt_texts: list[str] = []
        self.prompt_token_ids: list[list[int]] = []

    def set_prompts(self, texts: list[str], token_ids: list[list[int]]) -> None:
        self.prompt_texts, self.prompt_token_ids = texts, token_ids

    def echo(self, key, out, state, token_texts):
        if not self.want_echo:
            return None
        index = key // self.n
        text = self.prompt_texts[index]
        if not self.want_logprobs:
            return text, None
        ids = self.prompt_token_ids[index]
        entries = out.prompt_logprobs or []
        tokens = [token_texts.get(t, "") for t in ids]
        chosen: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for i, token_id in enumerate(ids):
            entry = entries[i] if i < len(entries) else None  # None: the first token
            chosen.append(None if entry is None else _finite(entry[token_id]))
            tops.append(
                None
                if entry is None
                else {token_texts.get(t, ""): _finite(lp) for t, lp in entry.items()}
            )
        return text, {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": tops,
            "text_offset": _offsets(tokens, state),
        }

    def join_logprobs(self, prompt, completion):
        if prompt is None or completion is None:
            return completion if prompt is None else prompt
        return {name: prompt[name] + completion[name] for name in completion}

    def delta_choice(self, key, delta, logprobs, finish_reason):
        return {"index": key, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def full_choice(self, key, text, logprobs, finish_reason):
        return {"index": key, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, sample, start, end, token_texts, state):
        ids = sample.token_ids[start:end]
        tokens = [token_texts.get(t, "") for t in ids]
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in (sample.logprobs or [])[start:end]],
            "top_logprobs": [
                {token_texts.get(t, ""): _finite(lp) for t, lp in _top(sample, i).items()}
                for i in range(start, end)
            ],
            "text_offset": _offsets(tokens, state),
        }


def _offsets(tokens: list[str], state: ChoiceState) -> list[int]:
    """Each token's offset in the choice's text (from `state`, which moves past them)."""
    offsets = []
    for text in tokens:
        offsets.append(state.text_offset)
        state.text_offset += len(text)
    return offsets


def _tool_finish(finish_reason: str | None, calls: list[Any]) -> str | None:
    """ "tool_calls" for a choice that stopped with calls (OpenAI's), else as it ended."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _call_deltas(calls: list[tuple[str, str]], state: ChoiceState) -> list[dict[str, Any]]:
    """OpenAI's tool_calls deltas for (name, arguments so far) of each call: a new call's
    id, type and name with the arguments it has, then each call's new arguments text."""
    deltas = []
    for index, (name, arguments) in enumerate(calls):
        if index == len(state.call_chars):
            deltas.append(ToolCall(name, arguments).to_json(index))
            state.call_chars.append(len(arguments))
        elif len(arguments) > state.call_chars[index]:
            new = arguments[state.call_chars[index] :]
            deltas.append({"index": index, "function": {"arguments": new}})
            state.call_chars[index] = len(arguments)
    return deltas


class ChatFormat(Format):
    """Chat shapes; with `tools`, outputs are read into `tool_calls` (server/tools.py): a
    stream sends content while it is surely content, each call's id and name once they are
    known and its arguments as deltas while they are generated; the deltas assemble to the
    non-streamed calls (the arguments are the model's own text, which only grows)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolMode | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tools = tools

    def stream_choice(self, key, out, sample, state, token_texts):
        if self.tools is None:
            return super().stream_choice(key, out, sample, state, token_texts)
        sample = self.visible(sample)
        if sample.finish_reason is None:
            content = self.tools.streamable_content(sample.text)
            grown = [(c.name, c.arguments or "") for c in self.tools.call_texts(sample.text)]
        else:
            content, calls = self.tools.calls(sample.text)
            content = content or ""
            grown = [(c.name, c.arguments) for c in calls]
        delta: dict[str, Any] = {}
        if len(content) > state.num_chars:
            delta["content"] = content[state.num_chars :]
            state.num_chars = len(content)
        if deltas := _call_deltas(grown, state):
            delta["tool_calls"] = deltas
        if sample.finish_reason is None:
            if not delta:
                return None
            state.started = True
            return {"index": key, "delta": delta, "logprobs": None, "finish_reason": None}
        state.finished, state.started = True, True
        finish = _tool_finish(sample.finish_reason, grown)
        return {"index": key, "delta": delta, "logprobs": None, "finish_reason": finish}

    def final_choice(self, key, out, sample, token_texts):
        choice = super().final_choice(key, out, sample, token_texts)
        if self.tools is None:
            return choice
        content, calls = self.tools.calls(choice["message"]["content"])
        if calls:
            choice["message"] = {
                "role": "assistant",
                "content": content,
                "tool_calls": [call.to_json() for call in calls],
            }
            choice["finish_reason"] = _tool_finish(choice["finish_reason"], calls)
        return choice

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
