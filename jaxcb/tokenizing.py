"""Tokenizing prompts away from the engine thread, and bounding a prompt's length cheaply.

The engine's tokenizer detokenizes on the engine thread; a Hugging Face fast tokenizer must
not be used by two threads at once, so a thread that tokenizes prompts (the server's, batch
inference's pipeline) gets an instance of its own from `own_tokenizer`.

`max_token_chars` lets a too-long prompt be refused without tokenizing it: if no token
covers more than L characters of the text, a text of C characters has at least ceil(C / L)
tokens. That holds when the tokenizer keeps every character of the text in some token, as
byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style BPE with byte fallback (Llama 2,
Mistral, Gemma) do; where the pipeline may drop or merge characters (whitespace-splitting
pre-tokenizers, normalizers that strip, unknown characters fused into one token) there is no
such bound, and such prompts are tokenized in full.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

# Unicode composition (NFC, NFKC) turns at most 4 code points into 1, e.g. U+1F87.
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def own_tokenizer(engine: Any) -> Any | None:
    """A copy of the engine's tokenizer (None if it has none), for one other thread: a deep
    copy holds its own Rust tokenizer (~0.07 s for a 49k vocabulary; building it again from
    a GGUF file's metadata took ~0.2-1 s)."""
    if engine.tokenizer is None:
        return None
    return copy.deepcopy(engine.tokenizer)


def max_token_chars(tokenizer: Any) -> int | None:
    """At most how many characters of a text one token stands for, or None where the
    tokenizer gives no such bound (see the module docstring). Walks the vocabulary: call it
    once per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: its pipeline is not inspectable
        return None
    pipeline = json.loads(backend.to_str())
    factor = _normalizer_factor(pipeline.get("normalizer"))
    if factor is None or not _keeps_pieces(pipeline.get("pre_tokenizer")):
        return None
    if not _model_keeps_text(pipeline.get("model") or {}):
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    return longest * factor if longest else None


def min_num_tokens(text: str, max_chars: int | None) -> int:
    """A lower bound on the tokens of `text` (0 if `max_chars` is None: no bound known)."""
    return math.ceil(len(text) / max_chars) if max_chars else 0


def _normalizer_factor(normalizer: dict | None) -> int | None:
    """How many characters of the text one character of the normalized text may stand for;
    None if the normalizer may drop characters."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            inner = _normalizer_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind == "Replace":  # a fixed string by one at least as long keeps the length
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "")
        return 1 if pattern is not None and len(content) >= len(pattern) else None
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSING_NORMALIZERS[kind]
    return 1 if kind in _KEEPING_NORMALIZERS else None


def _keeps_pieces(pre_tokenizer: dict | None) -> bool:
    """Whether the pre-tokenizer keeps every character (it splits, and drops nothing)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_pieces(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _model_keeps_text(model: dict) -> bool:
    """Whether unknown characters stay one token each at most (bytes, or unfused unknowns)."""
    if model.get("type") != "BPE":
        return model.get("type") == "Unigram" and bool(model.get("byte_fallback"))
    fused_unknowns = model.get("fuse_unk") and model.get("unk_token")
    return bool(model.get("byte_fallback")) or not fused_unknowns
