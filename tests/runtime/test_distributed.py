"""Multi-process jax on this machine: processes joined by jax.distributed on a loopback
coordinator, each with its own CPU devices, one tensor-parallel mesh across them (gloo
collectives), from safetensors or orbax. The same tokens as one process, the same schedule
in every process, only process 0 writing batch results, and a dead or hung process ending
the others with a one-line error within the heartbeat timeout.

Each process is a subprocess (distributed_worker.py, scripts/batch_infer.py): a process's
device count and its distributed runtime are fixed once jax starts. The watchdog's logic is
also unit tested here, without processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxcb.runtime import distributed

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")
BATCH_INFER = ROOT / "scripts" / "batch_infer.py"
TIMEOUT = 240  # seconds a whole multi-process run may take before the test gives up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with 4 KV heads (TP 2 and 4 divide it) and two layers, without
    tokenizer files: the workers send token ids, and each process saves the seconds that
    importing transformers' tokenizers costs."""
    from jaxcb.models.loading.default_model import CONFIG, write_random_llama

    path = tmp_path_factory.mktemp("distributed") / "tiny"
    config = dict(
        CONFIG,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=256,
        num_hidden_layers=2,
    )
    write_random_llama(path, config, seed=1, std=0.2)
    return path


@pytest.fixture(scope="module")
def text_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with its byte tokenizer, for batch_infer.py's text prompts."""
    import shutil

    from jaxcb.models.loading.default_model import save_byte_tokenizer

    path = tmp_path_factory.mktemp("distributed-text") / "tiny"
    shutil.copytree(model, path)
    save_byte_tokenizer(path)
    return path


def start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def workers(model: Path, processes: int, *extra: str, **per_process: list[str]) -> list:
    """`processes` workers on a fresh loopback port; per_process["p1"]: process 1's extra
    arguments."""
    port = str(free_port())
    return [
        start(
            [
                *(str(WORKER), str(model), "--processes", str(processes)),
                *("--process-id", str(i), "--port", port),
                *extra,
                *per_process.get(f"p{i}", []),
            ]
        )
        for i in range(processes)
    ]


def wait(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a process ran past {timeout}s: {err[-3000:]}")
    return proc.returncode, out, err


def report(proc: subprocess.Popen) -> dict:
    rc, out, err = wait(proc)
    assert rc == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])  # (gloo prints to stdout too)


def check_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    for g, w in zip(got["logprobs"], want["logprobs"], strict=True):
        assert (g is None) == (w is None) and (g is None or g == pytest.approx(w, abs=1e-4))
    ((got_prompt,), (want_prompt,)) = got["prompt_logprobs"], want["prompt_logprobs"]
    assert [[t for t, _ in e] for e in got_prompt] == [[t for t, _ in e] for e in want_prompt]
    flat = [lp for e in got_prompt for _, lp in e]
    assert flat == pytest.approx([lp for e in want_prompt for _, lp in e], abs=1e-4)


# ---- the same results as one process ----------------------------------------------------


@pytest.fixture(scope="module")
def reference(model: Path) -> dict:
    """What one process with one device gives."""
    want = report(start([str(WORKER), str(model)]))
    assert all(len(set(t)) > 3 for t in want["tokens"]), want["tokens"]  # diverse output
    return want


@pytest.mark.slow  # (the four-process test below checks the same, and more)
def test_two_processes_give_the_tokens_of_one(model: Path, reference: dict) -> None:
    """TP 2 over two processes (one CPU device each): greedy, seeded and logprob requests
    give what one process gives, and both processes packed the same step inputs."""
    want = reference
    got = [report(p) for p in workers(model, 2)]
    assert [(g["process_index"], g["process_count"], g["num_devices"]) for g in got] == [
        (0, 2, 2),
        (1, 2, 2),
    ]
    assert got[0]["schedule"] == got[1]["schedule"]
    for g in got:
        check_same(g, want)


def test_four_processes_orbax_async_give_the_tokens_of_one(
    model: Path, reference: dict, tmp_path: Path
) -> None:
    """TP 4 over four processes, one device each (about 20 s on a 2-core runner), from a
    jaxcb (orbax) checkpoint, each process restoring its own shards straight into the mesh,
    with async scheduling (a step ahead of the device: still the same steps everywhere)."""
    from jaxcb.models.loading.checkpoint_convert import convert_hf_checkpoint

    orbax_dir = convert_hf_checkpoint(model, tmp_path / "tiny-orbax")
    want = reference
    got = [report(p) for p in workers(orbax_dir, 4, "--async-scheduling")]
    assert {g["schedule"] for g in got} == {got[0]["schedule"]}
    assert [g["num_devices"] for g in got] == [4] * 4
    for g in got:
        check_same(g, want)


def test_batch_infer_two_processes_process_zero_writes(text_model: Path, tmp_path: Path) -> None:
    """scripts/batch_infer.py --distributed: the results of one process, written by
    process 0 alone (each process is given its own --output here to tell them apart)."""
    lines = [
        {"id": "a", "prompt": [5, 6, 7, 8]},
        {"id": "b", "prompt": "The quick brown fox", "max_tokens": 9},
        {"id": "c", "prompt": "hello", "temperature": 0.8, "top_k": 40, "seed": 7},
        {"id": "d", "prompt": "x y z", "temperature": 0.9},  # seeded from --sampling-seed
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = [str(BATCH_INFER), "--input", str(prompts), "--model", str(text_model)]
    common += ["--max-tokens", "8", "--no-progress", "--attention", "xla", "--matmul", "xla"]
    common += ["--max-model-len", "128", "--max-num-seqs", "4", "--token-buckets", "32"]
    common += ["--max-num-batched-tokens", "32", "--num-pages", "32"]
    port = free_port()
    reference = start([*common, "--output", str(tmp_path / "one.jsonl")])
    procs = [
        start(
            [
                *common,
                *("--output", str(tmp_path / f"out-{i}.jsonl"), "--tensor-parallel-size", "2"),
                *("--distributed", "--coordinator-address", f"127.0.0.1:{port}"),
                *("--num-processes", "2", "--process-id", str(i), "--heartbeat-timeout-s", "20"),
            ]
        )
        for i in range(2)
    ]
    for proc in (reference, *procs):
        rc, _, err = wait(proc)
        assert rc == 0, err[-4000:]
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    assert len(one) == 4
    assert (tmp_path / "out-0.jsonl").read_text().splitlines() == one
    assert not (tmp_path / "out-1.jsonl").exists()
    assert not (tmp_path / "out-1.jsonl.errors.jsonl").exists()


# ---- failures ---------------------------------------------------------------------------


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_a_dead_process_ends_the_others_with_one_line(model: Path) -> None:
    """Process 1 exits mid-run (its sockets close): process 0's step fails at once, and it
    exits 1 with one line rather than a traceback and a hang in jax's shutdown barrier."""
    procs = workers(
        model, 2, "--heartbeat-timeout", "10", "--max-tokens", "40", p1=["--fail", "exit"]
    )
    rc1, _, _ = wait(procs[1])
    died = time.monotonic()
    rc0, _, err0 = wait(procs[0], timeout=60)
    assert rc1 == 3
    assert rc0 == 1, err0[-3000:]
    assert time.monotonic() - died < 10 + 5  # within the heartbeat timeout
    line = last_line(err0)
    assert line.startswith("jaxcb: error: process 0 of 2: "), err0[-3000:]
    assert "a peer process has likely died" in line
    assert "Traceback" not in err0


def test_a_hung_process_ends_the_others_within_the_timeout(model: Path) -> None:
    """Process 1 freezes mid-run (SIGSTOP: its sockets stay open, as a hung host): process
    0, waiting in a collective, is ended by the watchdog once process 1's heartbeat has been
    silent for heartbeat_timeout_s."""
    timeout = 4
    procs = workers(
        model,
        2,
        "--heartbeat-timeout",
        str(timeout),
        "--max-tokens",
        "40",
        p1=["--fail", "freeze"],
    )
    try:
        for line in procs[1].stderr:  # it says so just before it stops
            if "freeze now" in line:
                break
        frozen = time.monotonic()
        rc0, _, err0 = wait(procs[0], timeout=TIMEOUT)
        assert rc0 == 1, err0[-3000:]
        assert time.monotonic() - frozen < timeout + 5
        line = last_line(err0)
        assert line == (
            f"jaxcb: error: process 0 of 2: process 1 sent no heartbeat for {timeout}s "
            "(heartbeat_timeout_s): dead or hung"
        ), err0[-3000:]
    finally:
        procs[1].send_signal(signal.SIGKILL)  # (it is stopped: only SIGKILL ends it)
        procs[1].communicate()


# ---- the watchdog and the settings, without processes -----------------------------------


class FakeClient:
    """The coordination service's key-value store, in memory; `down`: every call fails."""

    def __init__(self) -> None:
        self.store: dict[str, str] = {}
        self.down = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: connection refused")
        self.store[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.down:
            raise RuntimeError("UNAVAILABLE: connection refused")
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watchdogs(count: int, timeout: float = 10.0) -> tuple[list, FakeClient, Clock]:
    client, clock = FakeClient(), Clock()
    dogs = [
        distributed.PeerWatchdog(client, i, count, timeout, on_failure=print, clock=clock)
        for i in range(count)
    ]
    return dogs, client, clock


def test_watchdog_quiet_while_every_process_beats() -> None:
    dogs, _, clock = watchdogs(3)
    for _ in range(30):
        clock.now += 1.0
        for dog in dogs:
            dog.beat()
        assert [dog.check() for dog in dogs] == [None] * 3


def test_watchdog_names_the_silent_process() -> None:
    dogs, _, clock = watchdogs(3)
    for step in range(12):
        clock.now += 1.0
        for dog in dogs if step < 2 else dogs[:2]:  # process 2 stops after two beats
            dog.beat()
    assert dogs[0].check() is None  # 10 s is not yet over
    clock.now += 1.5
    dogs[0].beat()
    assert dogs[0].check() == (
        "process 2 sent no heartbeat for 10s (heartbeat_timeout_s): dead or hung"
    )


def test_watchdog_counts_from_its_start_for_a_peer_never_heard() -> None:
    dogs, _, clock = watchdogs(2)
    clock.now += 9.0
    dogs[0].beat()
    assert dogs[0].check() is None
    clock.now += 2.0
    assert "process 1 sent no heartbeat" in dogs[0].check()


def test_watchdog_reports_an_unreachable_coordinator() -> None:
    dogs, client, clock = watchdogs(2)
    client.down = True
    clock.now += 11.0
    with pytest.raises(RuntimeError):
        dogs[1].beat()  # (the beat thread logs this and goes on)
    assert dogs[1].check().startswith("the coordinator (process 0) has not answered for 11s")


def test_jax_heartbeat_is_a_later_backstop() -> None:
    assert distributed.jax_heartbeat_seconds(60) == 130
    assert distributed.jax_heartbeat_seconds(0.5) == 11


def test_multi_controller_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wall-clock-driven scheduling is off across processes: the ITL controller and swap;
    edf is refused. One process: the config is unchanged."""
    from jaxcb.config import EngineConfig

    config = EngineConfig.from_dict(None, itl_target_ms=50.0, preemption_mode="auto")
    assert distributed.multi_controller_config(config) is config
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    forced = distributed.multi_controller_config(config)
    assert forced.scheduler.itl_target_ms is None
    assert forced.scheduler.preemption_mode == "recompute"
    plain = EngineConfig.from_dict(None, async_scheduling=True)
    assert distributed.multi_controller_config(plain) is plain
    with pytest.raises(ValueError, match="scheduling_policy='edf' orders requests by wall-clock"):
        distributed.multi_controller_config(EngineConfig.from_dict(None, scheduling_policy="edf"))


def test_heartbeat_timeout_must_be_positive() -> None:
    from jaxcb.config import EngineConfig

    with pytest.raises(ValueError, match="heartbeat_timeout_s must be > 0"):
        EngineConfig.from_dict(None, heartbeat_timeout_s=0)
