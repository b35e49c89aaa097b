"""Per-request state: tokens, progress through the KV cache, pages, and life cycle.

WAITING ──admit──> RUNNING ──finish──> FINISHED (stop | length | abort | error)
   ^                  │
   └──── preempt ─────┘   (pages released, recomputed when re-admitted: from the first
                           page that is no longer in the prefix cache; or, preempted by
                           swap, their K/V copied to host slots first and copied back into
                           fresh pages when re-admitted: num_computed_tokens is kept)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from jaxcb.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(eq=False)
class Request:
    """One sequence being generated. (A prompt with `n > 1` becomes n of these.)"""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or one drawn from the engine's seed at arrival
    max_tokens: int  # output tokens at most (already clamped to max_model_len)
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0  # the "priority" policy admits lower values first (as vLLM)
    # Latency targets (the request's own, else the config's defaults): the "edf" policy's
    # deadline is arrival + TTFT target; its victims are those with the most TPOT slack.
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Prompt logprobs, if asked for (the first of n samples computes them): entry i for
    # prompt token i (None for the first), filled in by the prefill steps; a recompute after
    # preemption scores only the positions still missing.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    page_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the request failed, with finish_reason "error"
    # Prefix caching: chained hashes of the full pages of token_ids (computed lazily), how
    # many of page_ids are registered in the cache, and the prompt tokens the first
    # admission found cached (None until admitted).
    page_hashes: list[bytes] = field(default_factory=list)
    num_hashed_pages: int = 0
    num_cached_tokens: int | None = None
    # Preempted by swap (engine/sched/swap.py): the host slots holding the K/V of its first
    # ceil(num_computed_tokens / page_size) pages while it waits; None when not swapped out.
    swap_slots: list[int] | None = None
    # Computed tokens its last preemption by recompute dropped, until it is re-admitted (the
    # swap cost model learns from it how much the prefix cache gives back).
    num_dropped_tokens: int = 0
    # Set by the scheduler when the request first arrives there: its arrival order and
    # scheduler step (policies sort by them; they survive preemption).
    arrival_seq: int = -1
    arrival_step: int = -1
    # Admission (reserve | predicted): K/V positions the request was promised pages for
    # when admitted; the pages it does not hold yet stay spoken for. 0: none (greedy).
    num_reserved_tokens: int = 0
    # Async scheduling: tokens that dispatched steps are sampling for it and the host has
    # not read back yet (0 or 1 when a step is scheduled; 2 briefly, while the engine reads
    # the older one). They count in num_tokens: the next step is scheduled as if they were
    # here, and the device feeds them in (ScheduledChunk.prev_sample_row).
    num_inflight: int = 0
    # Structured outputs: the sequence's place in its grammar (engine/grammar.Matcher),
    # advanced with each token it appends; None when the output is unconstrained.
    grammar: Any = None
    # Speculative decoding (engine/spec/): the tokens its proposer guesses follow its newest
    # one, for the next step to verify (the scheduler may feed fewer); and the proposer's
    # own state for it (an n-gram index, ...).
    draft_token_ids: list[int] = field(default_factory=list)
    proposer_state: Any = None
    # LoRA (engine/lora_slots.py): the adapter it runs under (its lora_int_id; 0: the base
    # model), the root its prefix-cache page hashes chain from (the adapter's, so two
    # adapters never share pages; b"": the base model's), and the device slot it holds while
    # running (0: none).
    lora_id: int = 0
    lora_key: bytes = b""
    lora_slot: int = 0
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt, then output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_inflight

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def next_prompt_logprob_position(self) -> int | None:
        """The first position whose row still has to score the next prompt token (row p
        scores prompt token p + 1); None when no prompt logprob is missing."""
        if self.prompt_logprobs is None:
            return None
        position = len(self.prompt_logprobs) - 1
        return position if position < self.num_prompt_tokens - 1 else None

    @property
    def is_decoding(self) -> bool:
        """All tokens but the newest are in the cache: it needs exactly one token this step."""
        return self.num_uncomputed_tokens == 1

    @property
    def reached_max_tokens(self) -> bool:
        """Its tokens in flight take it to max_tokens: it finishes when they are read back,
        so it is never scheduled again (async scheduling; without tokens in flight such a
        request has finished already)."""
        return len(self.output_token_ids) + self.num_inflight >= self.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append a sampled token (and advance the grammar past it: a token it does not
        allow raises ValueError, and the engine fails this request)."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def check_stop_tokens(self, max_model_len: int) -> None:
        """Set finish_reason from the newest token and the length limits."""
        token = self.output_token_ids[-1]
        if not self.params.ignore_eos and token in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", None
        elif token in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif self.grammar is not None and self.grammar.is_finished:
            self.finish_reason, self.stop_reason = "stop", None  # nothing more may follow
        elif len(self.output_token_ids) >= self.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = "length"
