"""`python -m jaxcb.bench simulate_routing`: run small, prefix affinity's hit rate beats
round-robin's (the router's policies, over the simulated replicas)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from jaxcb.bench.routing_sim import SimConfig, simulate, synthetic_trace


def test_affinity_beats_round_robin_small() -> None:
    trace = synthetic_trace(1500, rate=40.0, num_groups=200, seed=1)
    config = SimConfig(num_replicas=8, cache_prefixes=16, max_imbalance=2)
    prefix = simulate(trace, "prefix", config)
    round_robin = simulate(trace, "round-robin", config)
    assert prefix["hit_rate"] > 1.3 * round_robin["hit_rate"]
    assert prefix["ttft_mean_s"] < round_robin["ttft_mean_s"]
    assert prefix["routed_min"] > 0  # every replica gets work


def test_command_runs_and_bad_input_is_one_line(tmp_path) -> None:
    out = tmp_path / "routing.json"
    command = [sys.executable, "-m", "jaxcb.bench", "simulate_routing"]
    run = subprocess.run(
        [*command, "--num-replicas", "4", "--num-requests", "300", "--rate", "20",
         "--num-groups", "40", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"prefix", "least-loaded", "round-robin"}
    assert results["prefix"]["hit_rate"] > results["round-robin"]["hit_rate"]
    assert "round-robin" in run.stdout  # the table
    bad = subprocess.run(
        [*command, "--rate", "0"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert bad.returncode == 2 and "rate > 0" in bad.stderr


@pytest.mark.parametrize("policy", ["random"])
def test_unknown_policy(policy: str) -> None:
    with pytest.raises(ValueError, match="not one of"):
        simulate(synthetic_trace(5, rate=1.0, num_groups=2), policy, SimConfig(num_replicas=2))
