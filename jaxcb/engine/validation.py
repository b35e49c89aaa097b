"""What a request may ask for: its sampling parameters and priority against the config's
limits, its prompt turned into token ids and checked against the model. Every problem is a
ValueError naming the field and the limit; nothing here changes any state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcb.config import EngineConfig, LimitsConfig
from jaxcb.engine.interface import MAX_TOP_LOGPROBS
from jaxcb.sampling_params import SamplingParams


def check_params(params: SamplingParams, priority: int, config: EngineConfig) -> None:
    """SamplingParams valid and within the limits; `priority` an int the policy can use."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
    params.validate()
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    policy = config.scheduler.scheduling_policy
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority} needs scheduling_policy='priority' (this engine uses {policy!r})"
        )
    limits = config.limits
    if params.n > limits.max_n:
        raise ValueError(f"SamplingParams.n must be <= max_n={limits.max_n}, got {params.n}")
    cap = limits.max_output_tokens
    if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
        raise ValueError(
            f"SamplingParams.max_tokens must be <= max_output_tokens={cap}, got {params.max_tokens}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > MAX_TOP_LOGPROBS:
            raise ValueError(f"SamplingParams.{name} must be <= {MAX_TOP_LOGPROBS}, got {value}")


def encode_prompt(
    prompt: str | Sequence[int], tokenizer: Any | None, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(the prompt text or None, its token ids): a string is tokenized (special tokens
    added), a sequence of ids is checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token id lists")
        ids = list(tokenizer(prompt)["input_ids"])
        text = prompt
    elif isinstance(prompt, Sequence | np.ndarray):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad or not all(isinstance(t, int | np.integer) for t in prompt):
            raise ValueError(
                f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}"
            )
        text = None
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}")
    if not ids:
        raise ValueError("prompt is empty")
    return text, ids


def check_prompt_length(num_tokens: int, max_model_len: int, limits: LimitsConfig) -> None:
    if num_tokens > max_model_len:
        raise ValueError(
            f"prompt has {num_tokens} tokens, longer than max_model_len={max_model_len}"
        )
    if limits.max_prompt_len is not None and num_tokens > limits.max_prompt_len:
        raise ValueError(
            f"prompt has {num_tokens} tokens, more than max_prompt_len={limits.max_prompt_len}"
        )
