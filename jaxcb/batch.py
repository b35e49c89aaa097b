"""Offline batch inference over a JSONL file, resumable: what scripts/batch_infer.py runs.

    input line:   {"id": "q1", "prompt": "Hello"}                       (or token ids)
                  {"id": "q2", "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 64, "temperature": 0.7}                 (per-line sampling)
    output line:  {"id": "q1", "outputs": [{"text", "token_ids", "finish_reason"}],
                   "usage": {"prompt_tokens", "completion_tokens"}}
    errors line:  {"line": 7, "id": "q7", "error": "..."}

A grain pipeline reads lines by offset (an index of line starts is all it keeps of the file),
parses them and tokenizes them on its own thread, a bounded buffer ahead of the engine. The
engine is fed continuously: whenever fewer than `max_in_flight` requests are in it, more are
added, and each result is written (and flushed) the moment its request finishes, in finish
order. Memory is bounded by the buffer and `max_in_flight`, not by the file.

Resuming: on start the ids already in the output and the line numbers already in the errors
file are skipped, and a half-written last line (a crash mid-write) is cut off first. A crash,
SIGKILL or Ctrl-C therefore loses only unfinished requests, which the next run recomputes, and
duplicates nothing. Lines without a seed get one derived from `--seed` and their id, so a
sampled line draws the same tokens whichever run computes it.

A line's sampling fields sit at its top level or under "sampling_params" (any SamplingParams
field); a line without "id" is known by its line number (1-based). A line that cannot be
parsed, has no prompt, repeats an id, or is rejected by the engine goes to the errors file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
RESERVED_FIELDS = frozenset({"id", "prompt", "messages", "sampling_params"})
INDEX_CHUNK_BYTES = 1 << 24


# ---- reading ----------------------------------------------------------------------------


class JsonlSource:
    """Random access to the lines of a file, for grain: item i is (line number, raw bytes).

    Only the offsets of line starts are kept (8 bytes a line); lines are read with pread,
    so any number of reader threads may share it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
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

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
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
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.defaults = defaults
        self.base_seed = base_seed
        self.done_ids = done_ids
        self.done_lines = done_lines
        self.shard_index, self.num_shards = shard

    def __call__(self, element: tuple[int, bytes]) -> Item:
        line, raw = element
        if line % self.num_shards != self.shard_index or line in self.done_lines:
            return Item(line, skip=True)
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
            ids = tok(text, add_special_tokens=False)["input_ids"]  # the template has any BOS
        elif isinstance(record["prompt"], str):
            if tok is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            ids = tok(record["prompt"])["input_ids"]
        elif isinstance(record["prompt"], list):
            ids = record["prompt"]
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        return list(ids)


def pipeline(source: JsonlSource, prepare: Prepare, prefetch: int) -> Iterator[Item]:
    """grain: read and prepare lines in order on a background thread, `prefetch` ahead."""
    import grain

    dataset = grain.MapDataset.source(source).map(prepare)
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))


# ---- writing ----------------------------------------------------------------------------


def from_process_zero(values: set[Any]) -> set[Any]:
    """Process 0's copy of `values` on every process of a multi-host job: only process 0
    writes the files, and every process must skip the same lines to stay in step."""
    import jax

    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(sorted(values)).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int64)))
    padded = np.zeros(size, np.uint8)
    padded[: min(size, len(data))] = data[:size]
    data = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return set(json.loads(data.tobytes()))


def recover(path: Path, key: str) -> set[Any]:
    """Values of `key` in a JSONL results file, after cutting off a half-written last line."""
    seen: set[Any] = set()
    if not path.exists():
        return seen
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":  # the process died mid-line: drop that line
                f.seek(0)
                keep = f.read().rfind(b"\n") + 1
                f.truncate(keep)
                logger.warning("%s: dropped a half-written last line", path)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)[key]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number} is not a result line ({exc})") from None
            seen.add(id_key(value) if key == "id" else value)
    return seen


class Writer:
    """Append JSON lines and flush each one: once written, a line survives a crash."""

    def __init__(self, path: Path | None) -> None:
        self._file = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def result_record(item_id: Any, out: RequestOutput) -> dict[str, Any]:
    return {
        "id": item_id,
        "outputs": [
            {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
            for o in out.outputs
        ],
        "usage": {
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": sum(len(o.token_ids) for o in out.outputs),
        },
    }


# ---- the loop ---------------------------------------------------------------------------


@dataclass
class BatchStats:
    done: int = 0  # results written in this run
    errors: int = 0  # error lines written in this run
    skipped: int = 0  # lines done by an earlier run
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def run_batch(
    engine: Any,
    input_path: str | Path,
    output_path: str | Path,
    errors_path: str | Path,
    *,
    defaults: dict[str, Any] | None = None,
    base_seed: int = 0,
    max_in_flight: int = 256,
    prefetch: int = 512,
    progress: bool = True,
    writer: bool = True,
    shard: tuple[int, int] = (0, 1),
) -> BatchStats:
    """Run every line of `input_path` not yet in `output_path` / `errors_path` through
    `engine` (an LLMEngine or ReplicatedEngine). `writer=False`: read and compute but write
    nothing (the other processes of a multi-host job). `shard=(i, n)`: only lines whose
    number is i modulo n (n independent jobs, each with its own output, share a file)."""
    output_path, errors_path = Path(output_path), Path(errors_path)
    done_ids = from_process_zero(recover(output_path, "id") if writer else set())
    done_lines = from_process_zero(recover(errors_path, "line") if writer else set())
    index, num_shards = shard
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in [0, {num_shards})")
    source = JsonlSource(input_path)
    prepare = Prepare(
        _own_tokenizer(engine),
        engine.info.vocab_size,
        dict(defaults or {}),
        base_seed,
        done_ids,
        done_lines,
        shard,
    )
    items = pipeline(source, prepare, prefetch)
    results = Writer(output_path if writer else None)
    errors = Writer(errors_path if writer else None)
    stats = BatchStats()
    seen: set[str] = set()  # ids met so far in the file: a repeated one is an error
    pending: dict[str, Item] = {}  # engine request id -> its line
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(range(index - 1 if index else num_shards - 1, len(source), num_shards)),
            initial=len(done_ids) + len(done_lines),
            desc="batch",
            unit="req",
            dynamic_ncols=True,
        )
    start = time.perf_counter()

    def report(item: Item, message: str) -> None:
        errors.write({"line": item.line, "id": item.id, "error": message})
        stats.errors += 1
        if bar is not None:
            bar.update(1)

    try:
        exhausted = False
        while True:
            while not exhausted and len(pending) < max_in_flight:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                if item.skip:
                    if bar is not None and item.blank:
                        bar.update(1)
                    continue
                # An id belongs to the first line that runs with it (or ran, in an earlier
                # run); a later line with the same id is an error. Lines that fail do not
                # claim their id, so a rerun, which skips them, decides the same way.
                key = id_key(item.id)
                if item.error is None and key in seen:
                    item.error = f"duplicate id {item.id!r}"
                if item.error is not None:
                    report(item, item.error)
                    continue
                seen.add(key)
                if item.done:
                    stats.skipped += 1  # already counted in the bar's initial value
                    continue
                request_id = str(item.line)
                try:
                    engine.add_request(request_id, item.prompt_ids, item.params, final_only=True)
                except ValueError as exc:  # too long, beyond the limits, ...
                    seen.discard(key)
                    report(item, f"ValueError: {exc}")
                    continue
                pending[request_id] = item
            if not pending:
                if exhausted:
                    break
                continue
            for out in engine.step():
                if not out.finished:
                    continue
                item = pending.pop(out.request_id)
                if out.error:
                    report(item, out.error)
                    continue
                record = result_record(item.id, out)
                results.write(record)
                stats.done += 1
                stats.prompt_tokens += record["usage"]["prompt_tokens"]
                stats.output_tokens += record["usage"]["completion_tokens"]
                if bar is not None:
                    bar.update(1)
                    rate = stats.output_tokens / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{rate:,.0f} out tok/s", refresh=False)
    finally:
        stats.seconds = time.perf_counter() - start
        for request_id in list(pending):  # on an error or Ctrl-C: free the engine's pages
            engine.abort_request(request_id)
        results.close()
        errors.close()
        source.close()
        if bar is not None:
            bar.close()
    return stats


def _own_tokenizer(engine: Any) -> Any:
    """A tokenizer instance for the pipeline thread alone: the engine's detokenizes on the
    main thread, and a Rust tokenizer must not be used by two threads at once."""
    if engine.tokenizer is None:
        return None
    from jaxcb.models.loader import load_tokenizer

    path = engine.config.tokenizer or engine.info.model_path
    return load_tokenizer(Path(path))
