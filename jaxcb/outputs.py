"""What generation returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    logprobs: list[float] | None = None  # chosen token's logprob per token, if requested
    top_logprobs: list[dict[int, float]] | None = None  # top-k per token, if requested

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Seconds on the time.monotonic clock."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed inside the engine
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, its logprob given the tokens before
    # it and the top-k's ({token id: logprob}, the prompt token first); None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    extra: dict = field(default_factory=dict)

    # Shortcuts to the first (often only) sample.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
