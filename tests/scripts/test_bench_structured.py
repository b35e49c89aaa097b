"""bench_structured.py end to end on the tiny model: every figure it reports is there and
sane (the real model's run is in docs/structured_outputs.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.slow  # ~50 s on 2 cores (the default buckets compile): --runslow
def test_bench_structured_reports_the_mask_cost(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_structured", SCRIPTS / "bench_structured.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "s.json"
    argv = ["--model", "jaxcb-tiny-random-llama-v1", "--num-seqs", "2", "--max-tokens", "4",
            "--iters", "2", "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    free, constrained, mask = result["free"], result["constrained"], result["mask"]
    assert free["tokens"] == 2 * 4 and free["steps"] >= 4 and free["step_ms"] > 0
    assert constrained["total"] == 2 and constrained["grammars_compiled"] == 2
    assert mask["host_us_per_row"] > 0 and mask["device_ms_masked"] > 0
    assert (
        mask["fraction_of_step"]
        == (mask["host_ms_per_step"] + mask["device_ms_per_step"]) / free["step_ms"]
    )
