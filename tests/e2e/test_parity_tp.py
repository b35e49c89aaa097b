"""Greedy parity with transformers under tensor parallelism 2, for four families by default and
every one the suite has a tiny model of with --runslow (tests/helpers.py FAMILIES), in one
subprocess with 2 CPU devices (parity_tp_worker.py): the families' parameter layouts and
their sharding rules (heads, MLP, experts, vocabulary) keep the tokens of one device; so do
LoRA adapters' slot arrays, sharded as their base weights are (peft's tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAMILIES

WORKER = Path(__file__).with_name("parity_tp_worker.py")
#: One family per parameter layout by default (Phi-3's fused checkpoint, Gemma's, a mixture
#: of experts'; llama's heads and MLP run under LoRA below); every family with --runslow.
DEFAULT_FAMILIES = {"phi3", "gemma3", "qwen3-moe"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    work = tmp_path_factory.mktemp("parity_tp")
    every = request.config.getoption("--runslow")
    families = sorted(f for f in FAMILIES if every or f in DEFAULT_FAMILIES)
    result = subprocess.run(
        [sys.executable, str(WORKER), str(work), *families],
        capture_output=True,
        text=True,
        timeout=1200,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(family, marks=() if family in DEFAULT_FAMILIES else pytest.mark.slow)
        for family in sorted(FAMILIES)
    ],
)
def test_tensor_parallel_parity(report: dict, family: str) -> None:
    run = report[family]
    assert run["kv_shards"] == 2 and run["preemptions"] > 0
    assert len({t for seq in run["expected"] for t in seq}) > 10  # not one repeated token
    assert run["got"] == run["expected"]


def test_tensor_parallel_lora_matches_peft(report: dict) -> None:
    run = report["lora"]
    assert run["kv_shards"] == 2 and run["preemptions"] > 0
    assert run["changed"] >= 3, "the adapters were meant to change the output"
    assert run["got"] == run["expected"]
