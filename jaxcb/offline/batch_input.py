"""The input side of batch inference (jaxcb/offline/batch.py): JSONL lines read by offset, parsed,
their sampling params built and their prompts tokenized, on a grain pipeline's thread.

Memory stays bounded by the line, not the file, and by the line's limit, not the line: a
line longer than `max_line_bytes` is reported without being read, and a prompt whose length
in characters already proves it too long is reported without being tokenized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxcb.sampling_params import SamplingParams
from jaxcb.tokenizing import max_token_chars, min_num_tokens

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
RESERVED_FIELDS = frozenset({"id", "prompt", "messages", "sampling_params"})
INDEX_CHUNK_BYTES = 1 << 22  # the index reads this much at a time (and as much again)


@dataclass(frozen=True)
class LongLine:
    """Stands for a line longer than the source reads: only its size is known."""

    num_bytes: int
    max_bytes: int


class JsonlSource:
    """Random access to the lines of a file, for grain: item i is (line number, raw bytes),
    or (line number, LongLine) for a line over `max_line_bytes`, which is not read.

    Only the offsets of line starts are kept (8 bytes a line); lines are read with pread,
    so any number of reader threads may share it.
    """

    def __init__(self, path: str | Path, max_line_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_line_bytes = max_line_bytes
        starts = [np.zeros(1, np.int64)]
        size = 0
        with open(self.path, "rb") as f:
            while chunk := f.read(INDEX_CHUNK_BYTES):
                newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n"))
                starts.append(newlines.astype(np.int64) + size + 1)
                size += len(chunk)
        offsets = np.concatenate(starts)
        if offsets[-1] != size:  # a last line without a final newline
            offsets = np.append(offsets, size)
        self._offsets = offsets  # line i is bytes [offsets[i], offsets[i + 1])
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> tuple[int, bytes | LongLine]:
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        limit = self.max_line_bytes
        if limit is not None and end - start > limit:
            return index + 1, LongLine(end - start, limit)
        return index + 1, os.pread(self._fd, end - start, start)

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class Item:
    """One input line, parsed: a request to run, a line to skip, or an error to report."""

    line: int
    id: Any = None
    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None
    skip: bool = False  # blank, another shard's, or reported as an error by an earlier run
    blank: bool = False
    done: bool = False  # its id has a result from an earlier run (not tokenized again)


def id_key(value: Any) -> str:
    """Ids compare as their JSON text: 5 and "5" are different ids."""
    return json.dumps(value, sort_keys=True)


class Prepare:
    """The grain map step: parse a line, build its SamplingParams, tokenize its prompt."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        defaults: dict[str, Any],
        base_seed: int,
        done_ids: set[str],
        done_lines: set[int],
        shard: tuple[int, int] = (0, 1),
        *,
        max_model_len: int | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = max_token_chars(tokenizer) if tokenizer is not None else None
        self.max_model_len, self.max_prompt_len = max_model_len, max_prompt_len
        self.vocab_size = vocab_size
        self.defaults = defaults
        self.base_seed = base_seed
        self.done_ids = done_ids
        self.done_lines = done_lines
        self.shard_index, self.num_shards = shard

    def __call__(self, element: tuple[int, bytes | LongLine]) -> Item:
        line, raw = element
        if line % self.num_shards != self.shard_index or line in self.done_lines:
            return Item(line, skip=True)
        if isinstance(raw, LongLine):
            return Item(
                line,
                error=f"the line is {raw.num_bytes} bytes, more than the {raw.max_bytes} a line "
                "may have (--max-line-mb); it was not read",
            )
        if not raw.strip():
            return Item(line, skip=True, blank=True)
        item = Item(line)
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError(f"a line must be a JSON object, got {type(record).__name__}")
            item.id = record.get("id", line)
            if not isinstance(item.id, str | int) or isinstance(item.id, bool):
                raise ValueError(f"id must be a string or an integer, got {item.id!r}")
            if id_key(item.id) in self.done_ids:
                item.done = True
                return item
            item.params = self._params(record, item.id)
            item.prompt_ids = self._tokenize(record)
        except Exception as exc:  # any bad line is reported, never fatal
            item.error = f"{type(exc).__name__}: {exc}"
        return item

    def _params(self, record: dict[str, Any], request_id: Any) -> SamplingParams:
        nested = record.get("sampling_params") or {}
        if not isinstance(nested, dict):
            raise ValueError("sampling_params must be an object")
        fields = {**self.defaults, **{k: v for k, v in record.items() if k in SAMPLING_FIELDS}}
        fields.update(nested)
        unknown = sorted(set(nested) - SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling_params {unknown}")
        if fields.get("seed") is None:  # the same draws whichever run computes this line
            digest = hashlib.sha256(f"{self.base_seed}:{id_key(request_id)}".encode()).digest()
            fields["seed"] = int.from_bytes(digest[:8], "little") >> 1
        return SamplingParams(**fields)

    def _tokenize(self, record: dict[str, Any]) -> list[int]:
        if ("prompt" in record) == ("messages" in record):
            raise ValueError('a line needs exactly one of "prompt" and "messages"')
        tok = self.tokenizer
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError("messages must be a list of objects")
            if tok is None or not getattr(tok, "chat_template", None):
                raise ValueError("this model's tokenizer has no chat template")
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self._encode(text, add_special_tokens=False)  # the template has any BOS
        elif isinstance(record["prompt"], str):
            if tok is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            ids = self._encode(record["prompt"], add_special_tokens=True)
        elif isinstance(record["prompt"], list):
            ids = record["prompt"]
            self._check_length(len(ids))  # before scanning a long list
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        return list(ids)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_length(min_num_tokens(text, self.max_token_chars), num_chars=len(text))
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _check_length(self, num_tokens: int, num_chars: int | None = None) -> None:
        """ValueError if the prompt is longer than the engine takes (the engine checks the
        exact count again); with `num_chars`, `num_tokens` is a lower bound from the text."""
        size = f"{num_tokens} tokens"
        if num_chars is not None:
            size = f"{num_chars} characters, so at least {num_tokens} tokens"
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {size}, longer than max_model_len={self.max_model_len}"
            )
        if self.max_prompt_len is not None and num_tokens > self.max_prompt_len:
            raise ValueError(
                f"the prompt has {size}, more than max_prompt_len={self.max_prompt_len}"
            )


def pipeline(source: JsonlSource, prepare: Prepare, prefetch: int) -> Iterator[Item]:
    """grain: read and prepare lines in order on a background thread, `prefetch` ahead."""
    import grain

    dataset = grain.MapDataset.source(source).map(prepare)
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))
