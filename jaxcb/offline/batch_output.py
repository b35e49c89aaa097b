"""The output side of batch inference (jaxcb/offline/batch.py): result and error lines appended and
flushed one by one, and what an earlier run already wrote, recovered on start.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxcb.offline.batch_input import id_key
from jaxcb.outputs import RequestOutput

logger = logging.getLogger(__name__)


def from_process_zero(values: set[Any]) -> set[Any]:
    """Process 0's copy of `values` on every process of a multi-host job: only process 0
    writes the files, and every process must skip the same lines to stay in step."""
    import jax

    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    from jaxcb.runtime.distributed import collective

    data = np.frombuffer(json.dumps(sorted(values)).encode(), np.uint8)
    with collective("broadcasting the lines already done"):
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
