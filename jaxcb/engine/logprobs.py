"""A step's logprobs into its requests: each sampled token's (with its top-k), and the prompt
logprobs that the step's prefill rows computed (SamplingParams.prompt_logprobs).

Prompt logprobs follow vLLM: entry i of a request's list is {prompt token i: its logprob
given tokens 0..i-1, then the top-k tokens at that position}, None for i = 0. The row at
position p scores prompt token p + 1, so the rows of positions 0 .. num_prompt_tokens - 2
carry them (the last prompt position samples the first output token instead). The step
computes them for the positions `ScheduledChunk.prompt_logprob_positions` names, chunk by
chunk: a prompt split over several steps fills its list in order, and a recompute after
preemption skips the positions already filled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxcb.engine.interface import StepResult
from jaxcb.engine.request import Request
from jaxcb.engine.sched.schedule import ScheduledChunk


def top_entry(ids: np.ndarray, values: np.ndarray, k: int) -> dict[int, float]:
    """{token id: logprob} of the first k of a row's top tokens (best first)."""
    return dict(zip(ids[:k].tolist(), values[:k].tolist(), strict=True))


def append_sample_logprobs(req: Request, result: StepResult, s: int) -> None:
    """The logprob of the token sampled for sequence row s, and its top-k if asked for."""
    req.output_logprobs.append(float(result.logprobs[s]))
    k = req.params.logprobs or 0
    if k > 0 and result.top_token_ids is not None:
        req.output_top_logprobs.append(
            top_entry(result.top_token_ids[s], result.top_logprobs[s], k)
        )


def record_prompt_logprobs(chunks: Sequence[ScheduledChunk], result: StepResult) -> None:
    """Append the prompt logprobs the step computed to their requests' lists (the rows come
    in the packer's order: chunk by chunk, position by position)."""
    if result.prompt_logprobs is None:
        return
    chosen = result.prompt_logprobs.tolist()
    row = 0
    for chunk in chunks:
        positions = chunk.prompt_logprob_positions
        if not positions:
            continue
        req = chunk.request
        k = req.params.prompt_logprobs or 0
        targets = req.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        entries: list[dict[int, float] | None] = [
            {target: chosen[row + i]} for i, target in enumerate(targets)
        ]
        if k > 0 and result.prompt_top_token_ids is not None:
            for i, entry in enumerate(entries):
                top = top_entry(
                    result.prompt_top_token_ids[row + i], result.prompt_top_logprobs[row + i], k
                )
                for token, value in top.items():
                    entry.setdefault(token, value)  # the prompt token stays first
        req.prompt_logprobs.extend(entries)
        row += len(targets)
