"""`python -m jaxcb.bench structured` end to end on the tiny model: every figure it reports is
there and sane (the real model's run is in docs/structured_outputs.md)."""

from __future__ import annotations

import json

import pytest

from jaxcb.bench.commands import main


@pytest.mark.slow  # ~50 s on 2 cores (the default buckets compile): --runslow
def test_structured_reports_the_mask_cost(tmp_path):
    out = tmp_path / "s.json"
    argv = ["--model", "jaxcb-tiny-random-llama-v1", "--num-seqs", "2", "--max-tokens", "4",
            "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert main(["structured", *argv]) == 0
    result = json.loads(out.read_text())
    free, constrained, mask = result["free"], result["constrained"], result["mask"]
    assert free["tokens"] == 2 * 4 and free["steps"] >= 4 and free["step_ms"] > 0
    assert constrained["total"] == 2 and constrained["grammars_compiled"] == 2
    assert mask["host_us_per_row"] > 0 and mask["device_ms_masked"] > 0
    assert (
        mask["fraction_of_step"]
        == (mask["host_ms_per_step"] + mask["device_ms_per_step"]) / free["step_ms"]
    )
