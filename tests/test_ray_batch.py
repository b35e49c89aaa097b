"""jaxcb/offline/ray_batch.py: batch inference over Ray actors on a local loopback cluster
writes every id exactly once when an actor is killed mid-run, retrying only that actor's
requests, and resumes over an output an earlier run left."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxcb.config import EngineConfig
from jaxcb.offline.batch import run_batch
from jaxcb.ray_support import RAY_MISSING, import_ray

ROOT = Path(__file__).resolve().parents[1]
NUM_LINES = 48
DONE_BEFORE = {"q1", "q2", "q3"}  # ids an "earlier run" wrote


def test_missing_ray_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r'pip install "jaxcb\[ray\]"') as info:
        import_ray()
    assert str(info.value) == RAY_MISSING


def _kill_when(output: Path, min_lines: int, pid: int, deadline: float) -> None:
    """SIGKILL actor process `pid` once `output` has `min_lines` lines (a crash mid-run)."""
    while time.monotonic() < deadline:
        if output.exists() and output.read_text().count("\n") >= min_lines:
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)


def test_killed_actor_exactly_once(tmp_path: Path) -> None:
    from jaxcb.offline.ray_batch import RayEngine
    from jaxcb.ray_support import import_ray

    try:
        ray = import_ray(loopback=True)  # before ray is imported: the cluster on loopback
    except ImportError:
        pytest.skip("ray is not installed")

    source = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": f"q{n}", "prompt": "hello world " * (n % 7 + 1), "max_tokens": 40})
        for n in range(1, NUM_LINES + 1)
    ]
    source.write_text("\n".join(lines) + "\n")
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    fake = {"outputs": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
    output.write_text("".join(json.dumps({"id": i, **fake}) + "\n" for i in sorted(DONE_BEFORE)))

    config = EngineConfig.from_yaml(ROOT / "configs/tiny-cpu.yaml", max_num_seqs=4)
    engine = RayEngine(config, 2, num_cpus_per_replica=1, batch_size=2, max_restarts=1)
    try:
        assert len(engine.actor_pids()) == 2
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        victim = engine.actor_pids()[1]
        killer = threading.Thread(
            target=_kill_when,
            args=(output, len(DONE_BEFORE) + 4, victim, time.monotonic() + 120),
            daemon=True,
        )
        killer.start()
        stats = run_batch(engine, source, output, errors, progress=False)
        killer.join(timeout=5)
        retried, deaths = engine.num_retried, engine.num_actor_deaths
    finally:
        engine.close()

    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert sorted(ids) == sorted(f"q{n}" for n in range(1, NUM_LINES + 1))  # exactly once
    assert stats.skipped == len(DONE_BEFORE) and stats.errors == 0
    assert stats.done == NUM_LINES - len(DONE_BEFORE)
    assert deaths == 1
    # only what the dead actor held is retried: at most its outstanding batches
    assert 1 <= retried <= engine.batches_per_replica * engine.batch_size
    assert not errors.exists() or errors.read_text() == ""
