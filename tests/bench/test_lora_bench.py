"""`python -m jaxcb.bench lora` on the tiny model: the three passes of a round and the load
test recorded, nothing compiled while an adapter loads, the new adapter's request answered."""

from __future__ import annotations

import json

from helpers import TINY_MODEL

from jaxcb.bench.commands import main


def test_lora_bench_records_passes_and_the_load(tmp_path):
    out = tmp_path / "lora.json"
    argv = ["--model", TINY_MODEL, "--workload", "offline-mixed", "--num-requests", "8",
            "--num-adapters", "2", "--rank", "4", "--repeats", "1",
            "--token-buckets", "16", "64", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "16", "--max-model-len", "512", "--json", str(out)]  # fmt: skip
    assert main(["lora", *argv]) == 0
    record = json.loads(out.read_text())
    (round_,) = record["rounds"]
    for mode in ("off", "base", "mixed"):
        assert round_[mode]["output_tokens"] == record["workload"]["output_tokens"]
    assert set(record["median_ratios"]) == {"base", "mixed"}
    load = record["load"]
    assert load["traced"] == 0 and load["answered"] and len(load["step_ms"]) == 24
    assert load["control"]["answered"] and load["max_over_control"] > 0
