"""Incremental detokenization with stop strings, for streaming and offline alike.

Decoding token by token is wrong for multi-byte characters and for tokenizers whose pieces
depend on their left neighbour, and decoding everything each step is quadratic. So each new
token re-decodes only a short window: the text of `tokens[prefix:]` minus the text of
`tokens[prefix:read]`. A window that ends inside a UTF-8 character (decoded as U+FFFD) is held
back until the character completes. While stop strings are pending, the last
`max(len(stop)) - 1` characters are held back too, so streamed text is always a prefix of the
final text.
"""

from __future__ import annotations

from typing import Any

PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded as left context of the first output token


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any | None,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any."""
        if self.tokenizer is None:
            return None
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str | None:
        """The request ended: emit what was held back for an incomplete character."""
        if self.tokenizer is None or self.stopped_by is not None:
            return None
        return self._advance(final=True)

    def _advance(self, final: bool) -> str | None:
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return None  # nothing printable yet (special token or an incomplete character)
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        found = [(i, stop) for stop in self.stop if (i := self.text.find(stop, start)) != -1]
        if not found:
            return None
        i, stop = min(found)  # the earliest stop string wins
        self.text = self.text[: i + len(stop)] if self.include_stop else self.text[:i]
        self.stopped_by = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text that can be shown now without ever being taken back."""
        if finished or not self.stop or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
