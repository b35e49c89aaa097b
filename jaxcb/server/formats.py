"""The JSON shapes of /v1/completions and /v1/chat/completions: whole responses, stream chunks,
choices, logprobs and usage. Choices are numbered `prompt_index * n + j`.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.submission import Submission

MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry


def usage(submission: Submission, outputs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for ids in submission.prompt_token_ids)
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
            "usage": usage(submission, outputs),
        }

    def stream_choice(
        self,
        key: int,
        sample: CompletionOutput,
        state: ChoiceState,
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
            logprobs = self.logprobs(sample, 0, len(sample.token_ids), token_texts, ChoiceState())
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


class ChatFormat(Format):
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
