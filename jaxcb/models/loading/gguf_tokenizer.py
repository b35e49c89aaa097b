"""A GGUF file's tokenizer and chat template, built from its metadata as transformers does.

transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`) reads
the file with a reader that imports torch, which jaxcb's runtime does not need. So the
metadata is read here (the gguf package) and handed, in the shape transformers' reader gives
it, to the builder transformers uses behind that call (`convert_gguf_tokenizer`: vocabulary
and merges, control tokens as special tokens, the pre-tokenizer's split for the file's
`tokenizer.ggml.pre`), which needs no torch. The token ids are transformers' by construction;
tests/models/test_gguf.py compares them.
"""

from __future__ import annotations

from typing import Any

from jaxcb.models.loading.gguf import GGUFFile
from jaxcb.models.weights import ModelLoadError

#: special token -> the metadata key of its id (tokenizer.ggml.<key>)
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def gguf_tokenizer(file: GGUFFile) -> Any | None:
    """The file's tokenizer as a transformers fast tokenizer (with the chat template the
    metadata holds); None if the metadata holds no vocabulary."""
    meta = file.metadata
    if "tokenizer.ggml.tokens" not in meta:
        return None
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as exc:
        raise ModelLoadError(
            f"building the tokenizer of {file.path} needs transformers>=5 (its GGUF "
            f"tokenizer builder): {exc}"
        ) from None
    from transformers import PreTrainedTokenizerFast

    # As transformers' get_gguf_tokenizer groups the metadata.
    groups = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    description, config = groups["tokenizer"], groups["tokenizer_config"]
    if description.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise
        config.setdefault("add_bos_token", True)
    tokens = description["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(file.architecture, description)
    except (ValueError, KeyError, IndexError) as exc:
        message = " ".join(str(exc).split())
        raise ModelLoadError(f"cannot build the tokenizer of {file.path}: {message}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
