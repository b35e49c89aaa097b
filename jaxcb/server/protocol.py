"""Request bodies of the OpenAI-compatible API, their validation, and the error shape.

Bodies are parsed strictly (a string where a number belongs is an error, not a conversion)
and every problem becomes an `APIError`, which the app turns into OpenAI's error JSON:
`{"error": {"message", "type", "param", "code"}}`. Fields OpenAI defines that jaxcb cannot
honour (suffix, logit_bias, tools, ...) are rejected with a 400 rather than ignored;
unknown fields are ignored, as OpenAI's own clients send a few optional ones. Completions'
`echo` returns the prompt before the completion (with `logprobs`, the prompt tokens'
logprobs too: SamplingParams.prompt_logprobs); `max_tokens` 0 is allowed with echo only.

jaxcb extensions beyond OpenAI's schema, as in vLLM: top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, priority (with
the "priority" scheduling policy), `return_token_ids` (adds `token_ids` to each choice,
for clients that need exact tokens), and the latency targets `ttft_target_ms` and
`tpot_target_ms` (the "edf" policy's deadlines; the server's defaults where absent). Limits
on n, max_tokens and the prompt length come from the engine's config (`limits`) and are
checked where the engine validates a request.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxcb.sampling_params import SamplingParams
from jaxcb.server.structured import StructuredOutputsError, structured_outputs_of
from jaxcb.server.tools import (
    ToolError,
    ToolMode,
    parse_tools,
    resolve_choice,
    template_call,
    tool_constraint,
)
from jaxcb.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # top-k logprobs per token (the engine computes at most 20)
INT32_MAX = 2**31 - 1


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- request bodies ---------------------------------------------------------------------


class _Body(BaseModel):
    # strict: JSON types must match (no "16" for 16); NaN and Infinity are not numbers here.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # accepted, not implemented


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "default"."""

    model: str | None = None
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=INT32_MAX)
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool | None = False
    # vLLM's extension: lower values are scheduled first (needs --scheduling-policy priority)
    priority: int | None = Field(default=0, ge=-INT32_MAX - 1, le=INT32_MAX)
    # jaxcb's: latency targets in ms for the "edf" policy (None: --ttft/tpot-target-ms)
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None
    # Structured outputs (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields (types checked there).
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "ttft_target_ms": self.ttft_target_ms,
            "tpot_target_ms": self.tpot_target_ms,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            kwargs["structured_outputs"] = structured_outputs_of(self)
        except StructuredOutputsError as exc:
            raise bad_request(str(exc), exc.param) from None
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                **kwargs,
            )
        except ValueError as exc:
            raise bad_request(str(exc), param_of(str(exc))) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string or a token id list each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # one prompt of token ids
        return list(p)

    def to_sampling_params(self, max_tokens_cap: int | None = None) -> SamplingParams:
        """`max_tokens_cap` (limits.max_output_tokens) lowers the default max_tokens of 16
        when the request gives none; a max_tokens given over the cap is the engine's error."""
        self._check_common()
        max_tokens = self.max_tokens
        if "max_tokens" not in self.model_fields_set and max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        if max_tokens == 0:
            if not self.echo:
                raise bad_request(
                    "max_tokens must be >= 1 (0 only with echo, for the prompt alone)",
                    "max_tokens",
                )
            max_tokens = 1  # generated and left out of the answer (formats.py), as vLLM
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of is not supported (it must equal n)", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs"
            )
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone."""
        return bool(self.echo) and self.max_tokens == 0


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            try:
                out["tool_calls"] = [template_call(c) for c in self.tool_calls]
            except ToolError as exc:
                raise bad_request(str(exc), exc.param) from None
        return out


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        return [m.template_dict() for m in self.messages]

    def to_sampling_params(self, max_tokens_cap: int | None = None) -> SamplingParams:
        """No max_tokens means up to max_model_len, or `max_tokens_cap` (the engine's)."""
        self._check_common()
        if self.functions:
            raise bad_request("functions are not supported: use tools", "functions")
        logprobs = None
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    "top_logprobs",
                )
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        params = self._sampling_params(max_tokens, logprobs)
        tools = self.tool_mode()
        constraint = tool_constraint(tools.choice, tools.tools, tools.parallel)
        if constraint is not None:  # required / a named function: the calls' schema
            if params.structured_outputs is not None:
                raise bad_request(
                    "tool_choice required or a named function constrains the output "
                    "already: leave out response_format and structured outputs",
                    "tool_choice",
                )
            params.structured_outputs = StructuredOutputsParams.of(constraint)
        return params

    def tool_mode(self, parser: str = "hermes") -> ToolMode:
        """How this request's tools are handled (server/tools.py); a bad `tools` or
        `tool_choice` is a 400 naming it."""
        try:
            tools = parse_tools(self.tools or [])
            choice = resolve_choice(self.tool_choice, tools)
            return ToolMode(choice, tools, parser, parallel=self.parallel_tool_calls is not False)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None


# ---- parsing ----------------------------------------------------------------------------

_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, or one or more lists of token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}

Body = TypeVar("Body", bound=_Body)


# LoRA adapters at run time (server/lora_adapters.py), as vLLM spells the bodies


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # (vLLM's body has it; the name decides here)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """Parse and validate a JSON body; any problem is a 400 naming the field."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("request body must be a JSON object")
    path = _data_path(first["loc"])
    param = ".".join(path) or None
    field = next((p for p in reversed(path) if not p.isdigit()), "")
    # A value matching no member of a union fails once per member: say what fits instead.
    union_failed = sum(_data_path(e["loc"])[: len(path)] == path for e in errors) > 1
    if field in _UNION_HINTS and union_failed:
        message = f"{param} {_UNION_HINTS[field]}"
    elif first["type"] == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {first['msg']}"
        value = first.get("input")
        if isinstance(value, int | float | str | bool) and len(repr(value)) < 80:
            message += f", got {value!r}"
    return bad_request(message, param)


def _data_path(loc: tuple[int | str, ...]) -> list[str]:
    """The JSON path of an error location, without the union member names pydantic adds
    ("prompt", "list[int]", 0 -> "prompt", "0")."""
    return [str(p) for p in loc if isinstance(p, int) or not _is_type_tag(p)]


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool"} or part.startswith("function-")


def param_of(message: str) -> str | None:
    """The field an engine's ValueError names: "SamplingParams.top_p must ...", or
    "priority=3 needs scheduling_policy='priority' ..." (LLMEngine.validate_request)."""
    match = re.search(r"SamplingParams\.(\w+)", message)
    if match:
        return match.group(1)
    return "priority" if message.startswith("priority") else None
