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

Order (`order`, jaxcb/offline/ordering.py): "arrival" feeds lines in file order. "prefix" and
"auto" read the stream in windows of `prefetch` requests and submit each window in that
order (prompts sharing a prefix together; with auto, decode-heavy first), a request that
shares pages with an earlier one held back until that one's prefill is done; the next window
is read once this one is all submitted. Ordering never crosses a window, so memory stays
bounded; it changes no result, only when each is computed and written. Duplicate ids and bad
lines are decided in file order while a window is read, so every order (and a resumed run)
decides them alike.

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

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxcb.offline.batch_input import Item, JsonlSource, Prepare, id_key, pipeline
from jaxcb.offline.batch_output import Writer, from_process_zero, recover, result_record
from jaxcb.offline.driver import OfflineDriver
from jaxcb.offline.ordering import check_order
from jaxcb.outputs import RequestOutput
from jaxcb.tokenizing import own_tokenizer

logger = logging.getLogger(__name__)


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
    max_line_bytes: int | None = 8 * 2**20,
    progress: bool = True,
    writer: bool = True,
    shard: tuple[int, int] = (0, 1),
    order: str = "arrival",
) -> BatchStats:
    """Run every line of `input_path` not yet in `output_path` / `errors_path` through
    `engine` (an Engine: LLMEngine or ReplicatedEngine). `writer=False`: read and compute but write
    nothing (the other processes of a multi-host job). `shard=(i, n)`: only lines whose
    number is i modulo n (n independent jobs, each with its own output, share a file).
    A line over `max_line_bytes` goes to the errors file without being read. `order`:
    "arrival", "prefix" or "auto", within windows of `prefetch` requests (module docstring)."""
    check_order(order)
    if order != "arrival" and prefetch < 1:
        raise ValueError(f"prefetch must be >= 1 to order the requests, got {prefetch}")
    output_path, errors_path = Path(output_path), Path(errors_path)
    done_ids = from_process_zero(recover(output_path, "id") if writer else set())
    done_lines = from_process_zero(recover(errors_path, "line") if writer else set())
    index, num_shards = shard
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in [0, {num_shards})")
    source = JsonlSource(input_path, max_line_bytes)
    prepare = Prepare(
        own_tokenizer(engine),
        engine.info.vocab_size,
        dict(defaults or {}),
        base_seed,
        done_ids,
        done_lines,
        shard,
        max_model_len=engine.max_model_len,
        max_prompt_len=engine.config.limits.max_prompt_len,
    )
    bar = None
    if progress:
        total = len(range(index - 1 if index else num_shards - 1, len(source), num_shards))
        bar = _progress_bar(total, initial=len(done_ids) + len(done_lines))
    run = _BatchRun(
        engine,
        max_in_flight,
        Writer(output_path if writer else None),
        Writer(errors_path if writer else None),
        bar,
    )
    try:
        items = pipeline(source, prepare, prefetch)
        if order == "arrival":
            run.feed(items)
        else:
            run.feed_ordered(items, order, prefetch)
    finally:
        run.close()
        source.close()
    return run.stats


def _progress_bar(total: int, initial: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="batch", unit="req", dynamic_ncols=True)


class _BatchRun:
    """The loop of `run_batch`: keep up to `max_in_flight` requests in the engine, and write
    each result (or error) the moment its request finishes."""

    def __init__(
        self, engine: Any, max_in_flight: int, results: Writer, errors: Writer, bar: Any
    ) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.results, self.errors, self.bar = results, errors, bar
        self.stats = BatchStats()
        self.seen: set[str] = set()  # ids met so far in the file: a repeated one is an error
        self.pending: dict[str, Item] = {}  # engine request id -> its line
        self.driver = OfflineDriver(
            engine,
            has_room=lambda: len(self.pending) < self.max_in_flight,
            on_finished=self._finish,
        )
        self.start = time.perf_counter()

    def feed(self, items: Iterator[Item]) -> None:
        """Lines in file order, as fast as `max_in_flight` lets them in."""
        exhausted = False
        while True:
            while not exhausted and self.driver.has_room():
                item = next(items, None)
                if item is None:
                    exhausted = True
                else:
                    self._add(item)
            if not self.pending:
                if exhausted:
                    break
                continue
            self.driver.step()

    def feed_ordered(self, items: Iterator[Item], order: str, window: int) -> None:
        """`feed` in `order` within windows of `window` requests (module docstring)."""
        exhausted = False
        while not exhausted:
            batch: list[Item] = []
            while not exhausted and len(batch) < window:
                item = next(items, None)
                if item is None:
                    exhausted = True
                elif self._claim(item, validate=True):
                    batch.append(item)
            self.driver.submit_in_order(
                [item.prompt_ids for item in batch],
                [item.params for item in batch],
                order,
                functools.partial(self._submit_nth, batch),
            )
        self.driver.drain()

    def _add(self, item: Item) -> None:
        if self._claim(item):
            self._submit(item)

    def _claim(self, item: Item, *, validate: bool = False) -> bool:
        """Report, skip or count the line; True if it is a request to submit. `validate`:
        check it against the engine now (ValueError: reported), so that an id is claimed
        only by a line that will run, whenever it is submitted."""
        if item.skip:
            if self.bar is not None and item.blank:
                self.bar.update(1)
            return False
        # An id belongs to the first line that runs with it (or ran, in an earlier run); a
        # later line with the same id is an error. Lines that fail do not claim their id,
        # so a rerun, which skips them, decides the same way.
        key = id_key(item.id)
        if item.error is None and key in self.seen:
            item.error = f"duplicate id {item.id!r}"
        if item.error is None and validate and not item.done:
            try:
                self.engine.validate_request(item.prompt_ids, item.params)
            except ValueError as exc:  # too long, beyond the limits, ...
                item.error = f"ValueError: {exc}"
        if item.error is not None:
            self._report(item, item.error)
            return False
        self.seen.add(key)
        if item.done:
            self.stats.skipped += 1  # already counted in the bar's initial value
            return False
        return True

    def _submit_nth(self, batch: list[Item], i: int, final_only: bool) -> str | None:
        return self._submit(batch[i], final_only=final_only)

    def _submit(self, item: Item, *, final_only: bool = True) -> str | None:
        """Add a claimed line's request to the engine; its request id, or None if the engine
        rejected it (reported, and its id freed)."""
        request_id = str(item.line)
        try:
            self.engine.add_request(request_id, item.prompt_ids, item.params, final_only=final_only)
        except ValueError as exc:  # too long, beyond the limits, ...
            self.seen.discard(id_key(item.id))
            self._report(item, f"ValueError: {exc}")
            return None
        self.pending[request_id] = item
        return request_id

    def _finish(self, out: RequestOutput) -> None:
        item = self.pending.pop(out.request_id)
        if out.error:
            self._report(item, out.error)
            return
        record = result_record(item.id, out)
        self.results.write(record)
        stats = self.stats
        stats.done += 1
        stats.prompt_tokens += record["usage"]["prompt_tokens"]
        stats.output_tokens += record["usage"]["completion_tokens"]
        if self.bar is not None:
            self.bar.update(1)
            rate = stats.output_tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} out tok/s", refresh=False)

    def _report(self, item: Item, message: str) -> None:
        self.errors.write({"line": item.line, "id": item.id, "error": message})
        self.stats.errors += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        """On an error or Ctrl-C too: free the engine's pages, close the files."""
        self.stats.seconds = time.perf_counter() - self.start
        for request_id in list(self.pending):
            self.engine.abort_request(request_id)
        self.results.close()
        self.errors.close()
        if self.bar is not None:
            self.bar.close()
