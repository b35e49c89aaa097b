"""Per-request sampling parameters, validated when created (before anything is scheduled)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jaxcb.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Defaults follow vLLM: `temperature=1.0` samples; `temperature=0` is greedy.
    `seed` makes a request's tokens independent of whatever else shares the batch.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token + top-k
    # None: off; k >= 0: each prompt token's logprob given the tokens before it, + top-k
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Latency targets in ms (None: the engine's scheduler defaults): the "edf" policy orders
    # the queue by arrival + ttft_target_ms and preempts by tpot_target_ms slack.
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None
    # What the output must match (a JSON schema, a regex, a choice, a grammar), enforced
    # token by token (engine/grammar.py); a dict of its fields is taken too.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        if self.max_tokens is not None:
            _require(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "must be an integer >= 1",
            )
        _require(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "must be >= 0",
        )
        _require(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            self.top_k,
            "must be an integer >= 0 (0 or -1 disables it)",
        )
        _require(
            _is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"
        )
        _require(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            self.min_p,
            "must be in [0, 1]",
        )
        if self.seed is not None:
            _require(_is_int(self.seed), "seed", self.seed, "must be an integer")
        _require(
            isinstance(self.stop, list | tuple)
            and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "must be non-empty strings",
        )
        _require(
            isinstance(self.stop_token_ids, list | tuple)
            and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must be non-negative integers",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(_is_int(value) and value >= 0, name, value, "must be an integer >= 0")
        _require(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            self.presence_penalty,
            "must be in [-2, 2]",
        )
        _require(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "must be in [-2, 2]",
        )
        _require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be > 0",
        )
        for name in ("ttft_target_ms", "tpot_target_ms"):
            value = getattr(self, name)
            if value is not None:
                _require(_is_number(value) and value > 0, name, value, "must be > 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, value, "must be a boolean")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (bools, NaN and infinities are not numbers here)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and value == value
        and abs(value) != math.inf
    )


def _as_list(value: object) -> object:
    """None -> [], a list or tuple -> a list; anything else is left for validate() to reject
    (list(5) would raise a TypeError, list("ab") would split a string)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else value


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")
