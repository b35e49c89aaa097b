"""A user request as the engine keeps it: its n samples (one `Request` each, scheduled on their
own) with their detokenizers, and the `RequestOutput` built from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxcb.config import EngineConfig
from jaxcb.engine.detokenizer import IncrementalDetokenizer
from jaxcb.engine.request import Request
from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxcb.sampling_params import SamplingParams

SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples


def new_sample(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    j: int,
    *,
    arrival: float,
    priority: int,
    rng: np.random.Generator,
    max_model_len: int,
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    lora: tuple[int, bytes] = (0, b""),
) -> Request:
    """Sample j of a request's n: its own id, seed and output budget; latency targets its
    own, or the config's defaults. `rng` draws the seeds of requests that give none.
    `lora`: its adapter's (lora_int_id, prefix-cache root); (0, b""): the base model."""
    room = max(1, max_model_len - len(prompt_ids))
    cap = config.limits.max_output_tokens or room
    if params.seed is not None:
        seed = (params.seed + j * SEED_STRIDE) % (1 << 64)
    else:
        seed = int(rng.integers(0, 1 << 63))
    sched = config.scheduler
    return Request(
        request_id=request_id if params.n == 1 else f"{request_id}-{j}",
        prompt_token_ids=prompt_ids,
        params=params,
        seed=seed,
        max_tokens=min(params.max_tokens or cap, cap, room),
        eos_token_ids=eos_token_ids,
        arrival_time=arrival,
        priority=priority,
        ttft_target_ms=_or(params.ttft_target_ms, sched.ttft_target_ms),
        tpot_target_ms=_or(params.tpot_target_ms, sched.tpot_target_ms),
        # the first sample computes the prompt logprobs for all n
        prompt_logprobs=[None] if params.prompt_logprobs is not None and j == 0 else None,
        lora_id=lora[0],
        lora_key=lora[1],
    )


def _or(value: float | None, default: float | None) -> float | None:
    return default if value is None else value


@dataclass
class RequestGroup:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    final_only: bool = False  # step() reports it once, when finished (offline generate)
    broken: bool = False  # building its output failed: texts are no longer available

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def detokenizer(self, child: Request) -> IncrementalDetokenizer:
        return self.detokenizers[self.children.index(child)]

    def output(self) -> RequestOutput:
        """The group's RequestOutput as of now (cumulative texts and tokens)."""
        outs = []
        for j, (req, detok) in enumerate(zip(self.children, self.detokenizers, strict=True)):
            want = req.params.logprobs is not None
            outs.append(
                CompletionOutput(
                    index=j,
                    text="" if self.broken else detok.visible_text(req.finished),
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=list(req.output_logprobs) if want else None,
                    top_logprobs=list(req.output_top_logprobs) if want else None,
                )
            )
        errors = list(dict.fromkeys(c.error for c in self.children if c.error))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            metrics=self._metrics(),
            error="; ".join(errors) or None,
            num_cached_tokens=self.children[0].num_cached_tokens or 0,
            prompt_logprobs=_copy(self.children[0].prompt_logprobs),
        )

    def _metrics(self) -> RequestMetrics:
        """The samples' times together: the first token of any, the last of all."""
        children = self.children
        first_tokens = [c.metrics.first_token_time for c in children if c.metrics.first_token_time]
        last_tokens = [c.metrics.last_token_time for c in children if c.metrics.last_token_time]
        first = children[0].metrics
        finished_time = None
        if self.finished:
            finished_time = max(c.metrics.finished_time or 0.0 for c in children)
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(first_tokens, default=None),
            last_token_time=max(last_tokens, default=None),
            finished_time=finished_time,
            num_preemptions=sum(c.metrics.num_preemptions for c in children),
        )


def _copy(entries: list | None) -> list | None:
    return None if entries is None else list(entries)
