"""`python -m jaxcb.bench host_gap` on the tiny model: both modes' rounds recorded, every
figure there (it wraps the runner's dispatch and collect, so a change there shows here)."""

from __future__ import annotations

import json

from helpers import TINY_MODEL

from jaxcb.bench.commands import main


def test_host_gap_records_both_modes(tmp_path):
    out = tmp_path / "gap.json"
    argv = ["--model", TINY_MODEL, "--num-seqs", "4", "--steps", "4", "--prompt-len", "8",
            "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert main(["host_gap", *argv]) == 0
    record = json.loads(out.read_text())
    for mode in ("async_off", "async_on"):
        rounds, medians = record[mode]["rounds"], record[mode]["medians"]
        assert len(rounds) == 2 and medians["rows"] == [4]
        assert medians["wall"] > 0 and medians["device"] > 0 and medians["steps"] == 8
    assert record["async_off"]["medians"]["idle"] == 8  # synchronously: every dispatch waits
