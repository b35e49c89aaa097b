"""Prompts to token ids, on the server's tokenizer thread, and the length checks.

The engine thread keeps the engine's tokenizer for detokenizing; prompts are tokenized (and
chat templates rendered) on one thread of their own, with a tokenizer instance of its own
(`PromptEncoder`), so tokenizing a long prompt never holds up the engine's steps. A string is
tokenized as `LLM.generate` tokenizes it (special tokens added), so the server and the
offline engine see the same ids; chat messages go through the tokenizer's chat template.

A text whose length in characters already proves it too long for max_model_len (or
max_prompt_len) is refused before it is tokenized (jaxcb/tokenizing.py has the bound).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxcb.sampling_params import SamplingParams
from jaxcb.server.protocol import APIError, bad_request
from jaxcb.tokenizing import max_token_chars, min_num_tokens, own_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages, rendered with the tokenizer's chat template (and the tools offered)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


Prompt = str | list[int] | ChatPrompt


def prompt_param(prompt: Prompt) -> str:
    """The request field an error about this prompt names."""
    return "messages" if isinstance(prompt, ChatPrompt) else "prompt"


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int
    max_prompt_len: int | None  # None: max_model_len
    vocab_size: int


class PromptEncoder:
    """Tokenizes prompts on a thread of its own, with a tokenizer of its own."""

    def __init__(self, engine: Any, chat_template: str | None = None) -> None:
        """`chat_template`: used instead of the tokenizer's (--chat-template)."""
        self.chat_template = chat_template
        self.limits = PromptLimits(
            engine.max_model_len, engine.config.limits.max_prompt_len, engine.info.vocab_size
        )
        self.tokenizer = own_tokenizer(engine)
        tokenizer = self.tokenizer
        self.max_token_chars = max_token_chars(tokenizer) if tokenizer is not None else None
        self._check_chat_template()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxcb-tokenizer")

    def _check_chat_template(self) -> None:
        """Render one user message at start-up. A template that cannot be rendered at all
        (jinja2 missing) is the server's fault, not every chat client's: ValueError, so the
        server refuses to start. A template that rejects this message is only logged (it may
        want other messages; each request then gets its own 400)."""
        template = self._template()
        if template is None:
            return
        try:
            self._render([{"role": "user", "content": "Hi"}], None, template)
        except ImportError as exc:
            raise ValueError(f"chat requests cannot be served: {exc}") from None
        except Exception as exc:
            logger.warning("the chat template fails on one user message: %s", exc)

    def _template(self) -> str | None:
        """The chat template requests are rendered with (--chat-template, else the
        tokenizer's); None without one or without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.chat_template or getattr(self.tokenizer, "chat_template", None) or None

    def _render(self, messages: list[dict[str, Any]], tools: Any, template: str) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )

    async def encode(self, prompts: list[Prompt], params: SamplingParams) -> list[list[int]]:
        """Token ids of each prompt; a 400 APIError naming the problem if one cannot be
        encoded, is empty, or is too long."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode_all, prompts, params)

    async def echo_texts(self, prompts: list[Prompt], token_ids: list[list[int]]) -> list[str]:
        """The text each prompt echoes (completions' `echo`): a text prompt as given, a
        prompt of token ids decoded (on the tokenizer thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._echo_texts, prompts, token_ids)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _echo_texts(self, prompts: list[Prompt], token_ids: list[list[int]]) -> list[str]:
        texts = []
        for prompt, ids in zip(prompts, token_ids, strict=True):
            if isinstance(prompt, str):
                texts.append(prompt)
            elif self.tokenizer is None:  # as the logprobs name such tokens
                texts.append("".join(f"token_id:{t}" for t in ids))
            else:
                texts.append(self.tokenizer.decode(ids))
        return texts

    def _encode_all(self, prompts: list[Prompt], params: SamplingParams) -> list[list[int]]:
        return [self._encode(prompt, params) for prompt in prompts]

    def _encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        param = prompt_param(prompt)
        if isinstance(prompt, list):
            ids = prompt
            check_length(len(ids), params, param, self.limits)  # before scanning a long list
            vocab_size = self.limits.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param)
        else:
            text, add_special_tokens = self._text(prompt)
            at_least = min_num_tokens(text, self.max_token_chars)
            check_length(at_least, params, param, self.limits, num_chars=len(text))
            ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise bad_request("the prompt is empty", param)
        check_length(len(ids), params, param, self.limits)
        return list(ids)

    def _text(self, prompt: str | ChatPrompt) -> tuple[str, bool]:
        """The text to tokenize, and whether the tokenizer adds its special tokens (BOS)."""
        tokenizer = self.tokenizer
        param = prompt_param(prompt)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send token id lists", param)
            return prompt, True
        template = self._template()
        if template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param)
        if prompt.tools and "tools" not in template:
            # A ChatML template that ignores tools (SmolLM2's): jaxcb's own, with Hermes calls.
            if "<|im_start|>" not in template:
                raise bad_request(
                    "this model's chat template does not render tools: give the server a "
                    "--chat-template that does",
                    "tools",
                )
            template = CHATML_TOOLS_TEMPLATE
        try:
            text = self._render(prompt.messages, prompt.tools, template)
        except ImportError as exc:  # the server's install, not the request
            raise APIError(500, str(exc), type="server_error") from None
        except Exception as exc:  # jinja errors, raise_exception() in templates
            raise bad_request(f"the chat template rejected the messages: {exc}", param) from None
        # The template writes any BOS itself; letting the tokenizer add one would double it.
        return text, False


#: jaxcb's ChatML template with tools (Hermes-style calls), for ChatML models whose own
#: template ignores tools.
CHATML_TOOLS_TEMPLATE = (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline; ValueError otherwise."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def check_length(
    num_tokens: int,
    params: SamplingParams,
    param: str,
    limits: PromptLimits,
    *,
    num_chars: int | None = None,
) -> None:
    """400 unless the prompt fits max_prompt_len and, with max_tokens, max_model_len (the
    engine would clamp max_tokens silently; an API client should hear about it, as with
    OpenAI and vLLM). With `num_chars`, `num_tokens` is a lower bound from the text's length."""
    if num_tokens == 0:  # no bound known (or an empty prompt: refused by the caller)
        return
    max_model_len, max_prompt_len = limits.max_model_len, limits.max_prompt_len
    size = f"{num_tokens} tokens"
    if num_chars is not None:
        size = f"{num_chars} characters, so at least {num_tokens} tokens"
    if num_tokens >= max_model_len:
        raise bad_request(
            f"the prompt has {size}, which leaves no room for output within "
            f"max_model_len={max_model_len}",
            param,
        )
    if max_prompt_len is not None and num_tokens > max_prompt_len:
        raise bad_request(
            f"the prompt has {size}, more than max_prompt_len={max_prompt_len}", param
        )
    if num_chars is not None:  # a text that may fit is short: its exact count says more
        return
    total = num_tokens + (params.max_tokens or 0)
    if params.max_tokens is not None and total > max_model_len:
        raise bad_request(
            f"the prompt ({size}) plus max_tokens ({params.max_tokens}) is {total} tokens, "
            f"more than max_model_len={max_model_len}; shorten the prompt or lower max_tokens",
            "max_tokens",
        )
