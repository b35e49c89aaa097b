"""scripts/batch_infer.py: a run killed part-way and restarted writes every id exactly once,
with the outputs of an uninterrupted run; bad lines go to the errors file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxcb.offline.batch_input import JsonlSource
from jaxcb.offline.batch_output import recover

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/batch_infer.py"
ENGINE_FLAGS = [
    "--config", str(ROOT / "configs/tiny-cpu.yaml"),
    "--max-num-seqs", "4",
    "--max-in-flight", "4",
    "--max-tokens", "24",  # the default of lines without max_tokens
    "--no-progress",
]  # fmt: skip
BAD_LINES = {  # line number -> (line, what the errors file says)
    5: ("{not json", "JSONDecodeError"),
    9: (json.dumps({"id": "p2", "prompt": "again"}), "duplicate id 'p2'"),
    13: (json.dumps({"id": "no-prompt"}), 'exactly one of "prompt" and "messages"'),
    17: (json.dumps({"id": "hot", "prompt": "x", "temperature": -1}), "temperature"),
    21: (json.dumps({"id": "long", "prompt": [5] * 600}), "longer than max_model_len"),
    25: ("[1, 2]", "must be a JSON object"),
    27: (json.dumps({"id": "re", "prompt": "x", "structured_outputs": {"regex": "("}}), "regex"),
}
# Lines whose output is constrained (structured outputs, per line): id -> (constraint, check)
STRUCTURED = {
    "s3": ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    "s4": ({"regex": "[0-9]{2}:[0-9]{2}"}, lambda t: len(t) == 5 and t[2] == ":"),
}


def write_input(path: Path, num_lines: int) -> None:
    lines = []
    for n in range(1, num_lines + 1):
        if n in BAD_LINES:
            lines.append(BAD_LINES[n][0])
        elif n == 30:
            lines.append("")  # blank lines are skipped, not errors
        elif f"s{n}" in STRUCTURED:
            so = STRUCTURED[f"s{n}"][0]
            lines.append(json.dumps({"id": f"s{n}", "prompt": "pick", "structured_outputs": so}))
        elif n % 11 == 0:  # chat, sampled without a seed (short: a long sampled sequence
            # may part ways after many tokens, as float sums differ between batch layouts)
            messages = [{"role": "user", "content": f"question {n}"}]
            sampled = {"temperature": 0.8, "max_tokens": 6}
            lines.append(json.dumps({"id": f"p{n}", "messages": messages, **sampled}))
        elif n % 7 == 0:  # no id: known by its line number; token-id prompt
            lines.append(json.dumps({"prompt": [3 + n, 4, 5], "max_tokens": 5}))
        else:
            ident = n if n % 5 == 0 else f"p{n}"
            prompt = "hello world " * (n % 9 + 1)
            lines.append(json.dumps({"id": ident, "prompt": prompt, "max_tokens": 10 + n % 30}))
    path.write_text("\n".join(lines) + "\n")


def command(input_path: Path, output: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--input", str(input_path), "--output", str(output)]


def run_to_end(input_path: Path, output: Path) -> None:
    result = subprocess.run(
        [*command(input_path, output), *ENGINE_FLAGS], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_id(records: list[dict]) -> dict[str, dict]:
    return {json.dumps(r["id"]): r for r in records}


def test_killed_and_restarted_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    input_path = tmp_path / "prompts.jsonl"
    write_input(input_path, 60)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    run_to_end(input_path, whole)

    # Start again into another file and SIGKILL it once a few results are written.
    proc = subprocess.Popen(
        [*command(input_path, resumed), *ENGINE_FLAGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if resumed.exists() and resumed.read_text().count("\n") >= 3:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = resumed.read_text().count("\n")
    assert proc.returncode == -signal.SIGKILL and 3 <= written < 52, written
    with open(resumed, "a") as f:  # as if it had died in the middle of a write
        f.write('{"id": "p4", "outputs": [{"te')
    run_to_end(input_path, resumed)

    expected, got = read(whole), read(resumed)
    assert len(got) == len({json.dumps(r["id"]) for r in got})  # every id exactly once
    assert by_id(got) == by_id(expected)
    assert len(expected) == 60 - len(BAD_LINES) - 1  # all but the bad and blank lines
    assert {7, 14} <= {r["id"] for r in expected}  # ids from line numbers
    assert all(r["outputs"][0]["token_ids"] for r in expected)
    for ident, (_, check) in STRUCTURED.items():
        assert check(by_id(expected)[json.dumps(ident)]["outputs"][0]["text"])
    errors = read(Path(f"{resumed}.errors.jsonl"))
    assert sorted(e["line"] for e in errors) == sorted(BAD_LINES)
    for e in errors:
        assert BAD_LINES[e["line"]][1] in e["error"], e
    assert errors == read(Path(f"{whole}.errors.jsonl"))

    # A third run has nothing left to do.
    run_to_end(input_path, resumed)
    assert read(resumed) == got


def test_source_and_recovery(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"b": 2}')  # a blank line, no final newline
    source = JsonlSource(path)
    assert len(source) == 3
    assert [source[i] for i in range(3)] == [(1, b'{"a": 1}\n'), (2, b"\n"), (3, b'{"b": 2}')]
    source.close()
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1}\n{"id": "1"}\n{"id": "half')
    assert recover(out, "id") == {"1", '"1"'}
    assert out.read_text() == '{"id": 1}\n{"id": "1"}\n'
    assert recover(tmp_path / "missing.jsonl", "id") == set()


class EchoEngine:
    """Stands in for LLMEngine: every request finishes in the next step, echoing its prompt."""

    class info:
        vocab_size = 100

    class config:
        class limits:
            max_prompt_len = None

    tokenizer = None
    max_model_len = 64

    def __init__(self) -> None:
        self.waiting: dict[str, list[int]] = {}
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params, *, final_only=False) -> str:
        if len(prompt) > 8:
            raise ValueError("too long")
        self.waiting[request_id] = list(prompt)
        self.added.append(request_id)
        return request_id

    def step(self):
        from jaxcb.outputs import CompletionOutput, RequestOutput

        done, self.waiting = self.waiting, {}
        return [
            RequestOutput(rid, None, p, [CompletionOutput(0, "", p[::-1], "length")], True)
            for rid, p in done.items()
        ]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def abort_request(self, request_id):
        self.waiting.pop(request_id, None)


def test_shards_split_the_file(tmp_path: Path) -> None:
    from jaxcb.offline.batch import run_batch

    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "prompt": [i % 100]}) for i in range(25)]
    lines[3] = json.dumps({"id": "long", "prompt": [1] * 9})
    path.write_text("\n".join(lines) + "\n")
    outputs = []
    for index in range(3):
        out = tmp_path / f"out{index}.jsonl"
        stats = run_batch(
            EchoEngine(), path, out, tmp_path / f"err{index}.jsonl", shard=(index, 3),
            progress=False,
        )  # fmt: skip
        outputs += read(out)
        assert stats.done + stats.errors == len(range(index or 3, 26, 3))
    assert sorted(r["id"] for r in outputs) == sorted(set(range(25)) - {3})
    assert read(tmp_path / "err1.jsonl")[0]["line"] == 4  # line 4 is 1 mod 3
    assert all(r["outputs"][0]["token_ids"] == [r["id"] % 100] for r in outputs)


def test_a_too_long_line_goes_to_the_errors_file_unread(tmp_path: Path) -> None:
    """A 20 MB line was read, parsed and tokenized whole (50 MB took 9.9 GB); now it is over
    the default --max-line-mb 8 and only its size is looked at."""
    import tracemalloc

    from jaxcb.offline.batch import run_batch

    path = tmp_path / "in.jsonl"
    huge = json.dumps({"id": "huge", "prompt": "x" * 20_000_000})
    path.write_text("\n".join([json.dumps({"id": 1, "prompt": [1]}), huge, '{"prompt": [2]}']))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    warm = tmp_path / "warm.jsonl"  # a first run imports the pipeline's modules
    warm.write_text('{"prompt": [1]}\n')
    run_batch(EchoEngine(), warm, tmp_path / "warm.out", tmp_path / "warm.err", progress=False)
    tracemalloc.start()
    try:
        stats = run_batch(EchoEngine(), path, out, err, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MiB allocated for a line that was not read"
    assert (stats.done, stats.errors) == (2, 1)
    (error,) = read(err)
    assert error["line"] == 2 and error["id"] is None
    assert f"{len(huge) + 1} bytes" in error["error"]  # with its newline
    assert "--max-line-mb" in error["error"]
    assert sorted(r["id"] for r in read(out)) == [1, 3]


def test_a_prompt_too_long_by_its_characters_is_not_tokenized(tmp_path: Path) -> None:
    from jaxcb.models.loading.default_model import default_model_dir
    from jaxcb.models.loading.loader import load_tokenizer
    from jaxcb.offline.batch_input import Prepare

    prepare = Prepare(
        load_tokenizer(default_model_dir()), 320, {}, 0, set(), set(), max_model_len=512
    )
    chat = {"messages": [{"role": "user", "content": "y" * 3000}]}
    for record in ({"prompt": "x" * 1_000_000}, chat):
        item = prepare((1, json.dumps(record).encode()))
        assert "characters, so at least" in item.error, item.error  # counted, not tokenized
        assert "max_model_len=512" in item.error, item.error
    item = prepare((1, json.dumps({"prompt": [5] * 513}).encode()))
    assert "513 tokens, longer than max_model_len=512" in item.error, item.error
    assert prepare((1, json.dumps({"prompt": "x" * 400}).encode())).prompt_ids


class PagedEchoEngine(EchoEngine):
    """EchoEngine with what ordering reads: a page size, the prefix cache switch and
    validate_request."""

    def __init__(self, caching: bool = True) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            limits=SimpleNamespace(max_prompt_len=None, max_output_tokens=None),
            cache=SimpleNamespace(page_size=2, enable_prefix_caching=caching),
        )

    def validate_request(self, prompt, params, *, priority=0):
        if len(prompt) > 8:
            raise ValueError("too long")
        return None, list(prompt)


@pytest.mark.parametrize("caching", [True, False])
def test_ordered_windows_group_prefixes_and_resume(tmp_path: Path, caching: bool) -> None:
    """--order prefix with --prefetch 5: each window of 5 requests is submitted grouped by
    prefix (skipped and bad lines take no place in a window), a request that shares a page
    with an earlier one held back until that one has a token (with the prefix cache on);
    every id is written once, and a rerun after a partial output computes only the rest."""
    from jaxcb.offline.batch import run_batch

    prompts = [[1, 1, 5], [2, 2, 5], [1, 1, 6], [3, 3], [2, 2, 6], [1, 1, 7], [2, 2, 7], [4, 4]]
    lines = [json.dumps({"id": k, "prompt": p}) for k, p in enumerate(prompts)]
    lines.insert(2, json.dumps({"id": "long", "prompt": [1] * 9}))  # rejected when read
    lines.insert(4, json.dumps({"id": 1, "prompt": [9]}))  # a repeated id
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    engine = PagedEchoEngine(caching)
    stats = run_batch(engine, path, out, err, order="prefix", prefetch=5, progress=False)
    assert (stats.done, stats.errors) == (8, 2)
    # window 1: ids 0-4 (lines 1, 2, 4, 6, 7), grouped 0 2 | 1 4 | 3, ids 2 and 4 held back
    # (with the cache) until 0 and 1 are done; window 2: ids 5-7, sharing nothing in it
    first = [1, 2, 6, 4, 7] if caching else [1, 4, 2, 7, 6]
    assert [int(r) for r in engine.added] == [*first, 8, 9, 10]
    assert sorted(r["id"] for r in read(out)) == list(range(8))
    assert all(r["outputs"][0]["token_ids"] == prompts[r["id"]][::-1] for r in read(out))
    assert [e["line"] for e in read(err)] == [3, 5]

    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(json.dumps(r) + "\n" for r in read(out)[:3]))
    engine = PagedEchoEngine()
    stats = run_batch(engine, path, resumed, err, order="auto", prefetch=5, progress=False)
    assert (stats.done, stats.skipped, stats.errors) == (5, 3, 0)
    assert len(engine.added) == 5
    assert sorted(r["id"] for r in read(resumed)) == list(range(8))
    with pytest.raises(ValueError, match="order must be one of"):
        run_batch(engine, path, resumed, err, order="random", progress=False)


def test_order_flag() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("batch_infer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.build_parser()
    base = ["--input", "a", "--output", "b"]
    assert parser.parse_args(base).order == "arrival"
    assert parser.parse_args([*base, "--order", "auto"]).order == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--order", "random"])
