"""Prompts to token ids, and the length check against max_model_len.

These run in the engine loop thread, the only thread that uses the tokenizer. A string is
tokenized as `LLM.generate` tokenizes it (special tokens added), so the server and the
offline engine see the same ids; chat messages go through the tokenizer's chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxcb.engine.interface import Engine
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.protocol import bad_request


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages, rendered with the tokenizer's chat template."""

    messages: list[dict[str, Any]]


Prompt = str | list[int] | ChatPrompt


def prompt_param(prompt: Prompt) -> str:
    """The request field an error about this prompt names."""
    return "messages" if isinstance(prompt, ChatPrompt) else "prompt"


def encode_prompt(engine: Engine, prompt: Prompt) -> list[int]:
    """Token ids of a prompt; a 400 APIError if it cannot be encoded or is empty."""
    tokenizer = engine.tokenizer
    param = prompt_param(prompt)
    if isinstance(prompt, ChatPrompt):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", param)
        try:
            text = tokenizer.apply_chat_template(
                prompt.messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja errors, raise_exception() in templates
            raise bad_request(f"the chat template rejected the messages: {exc}", param) from None
        # The template writes any BOS itself; letting the tokenizer add one would double it.
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send token id lists", param)
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        vocab_size = engine.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param)
        ids = list(prompt)
    if not ids:
        raise bad_request("the prompt is empty", param)
    return ids


def check_length(max_model_len: int, ids: list[int], params: SamplingParams, param: str) -> None:
    """400 unless the prompt plus max_tokens fits in max_model_len (the engine would clamp
    max_tokens silently; an API client should hear about it, as with OpenAI and vLLM)."""
    num = len(ids)
    if num >= max_model_len:
        raise bad_request(
            f"the prompt has {num} tokens, which leaves no room for output within "
            f"max_model_len={max_model_len}",
            param,
        )
    if params.max_tokens is not None and num + params.max_tokens > max_model_len:
        raise bad_request(
            f"the prompt ({num} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{num + params.max_tokens} tokens, more than max_model_len={max_model_len}; "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
        )
