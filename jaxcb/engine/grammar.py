"""Structured outputs on the host: a request's constraint compiled to a grammar, and a matcher
per sequence that says which tokens may come next.

The library is llguidance (Microsoft's, on PyPI; vLLM's "guidance" backend): JSON schemas,
regexes, choices and Lark / GBNF grammars; masks computed lazily per step in microseconds (no
ahead-of-time vocabulary walk, so a new schema costs little to compile); a Rust wheel with no
Python dependencies (xgrammar needs torch).

Each step, the runtime's packer (runtime/step_input.py) asks every constrained row's matcher
for its mask (`Matcher.fill`: a packed bit per vocabulary id, 1 = allowed) and the step
applies them to the logits before penalties, temperature and the filters; the engine feeds
each sampled token back (`Matcher.accept`). Unconstrained steps build no mask at all.

Pure Python and llguidance: no jax.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from jaxcb.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Compiled grammars kept (by constraint); the oldest is dropped past this.
CACHE_SIZE = 256
#: Whitespace characters allowed between two JSON tokens (see _grammar).
MAX_JSON_WHITESPACE = 16
#: The mask's word: 32 vocabulary ids a packed int32, bit i of word w = id 32 w + i.
WORD_BITS = 32


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's packed token mask."""
    return -(-vocab_size // WORD_BITS)


class Matcher:
    """One sequence's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill(self, mask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into mask[row] (int32 words, C-contiguous)."""
        view = mask[row]
        self._matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)

    def accept(self, token: int) -> None:
        """Advance past a sampled token; ValueError if the grammar does not allow it."""
        if not self._matcher.consume_token(token):
            raise ValueError(
                f"token {token} breaks the structured output: {self._matcher.get_error()}"
            )

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more than end of sequence."""
        return self._matcher.is_stopped()


_executor: llguidance.LLExecutor | None = None


def fill_masks(rows: list[tuple[int, Matcher]], mask: np.ndarray) -> None:
    """Each (row, matcher)'s allowed next tokens into mask[row], the rows computed in
    parallel on every core (llguidance's executor, outside the GIL) when there are several.
    The step waits for them anyway: constrained steps run synchronously."""
    global _executor
    if len(rows) == 1:
        row, matcher = rows[0]
        matcher.fill(mask, row)
        return
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=os.cpu_count() or 1)
    assert mask.dtype == np.int32 and mask.flags["C_CONTIGUOUS"]
    pairs = [(matcher._matcher, row) for row, matcher in rows]
    _executor.unsafe_compute_mask_ptr(pairs, mask.ctypes.data, mask.shape[1] * 4, mask.shape[0])


class GrammarCompiler:
    """Compiles constraints against one tokenizer (once: ~1 s, on first use) and keeps the
    compiled grammars by constraint. Thread-safe: the server compiles off the engine loop."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: Sequence[int]):
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # summed over the grammars compiled
        self.num_compiled = 0
        self.cache_hits = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise ValueError(
                    "structured_outputs needs a tokenizer, and this engine has none "
                    "(token-id prompts only)"
                )
            from llguidance.hf import from_tokenizer

            t0 = time.perf_counter()
            eos = self._eos if len(self._eos) != 1 else self._eos[0]
            self._tokenizer = from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=eos or None
            )
            logger.info("structured outputs: tokenizer ready in %.2fs", time.perf_counter() - t0)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams | None) -> str | None:
        """The grammar of a constraint, compiled and checked against the tokenizer (cached;
        None for None); a constraint the library rejects is a one-line ValueError naming the
        problem."""
        if params is None:
            return None
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return self._cache[key]
            tokenizer = self.tokenizer
        t0 = time.perf_counter()
        grammar = _grammar(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"invalid structured_outputs.{params.kind}: {_one_line(messages[0])}")
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the grammar's start."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {_one_line(matcher.get_error())}")
        return Matcher(matcher)


def _grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a constraint (errors in it surface at validation)."""
    kind = params.kind
    # Whitespace between JSON tokens: up to MAX_JSON_WHITESPACE characters a gap (enough to
    # indent), or none with disable_any_whitespace. Unbounded (vLLM's default) lets a small
    # model write spaces until max_tokens, leaving the JSON unfinished.
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"invalid structured_outputs.json: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"invalid structured_outputs.json: not a schema object: {schema!r}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs.grammar: {_one_line(str(exc))}") from None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:500]
