"""The micro-benchmarks on tiny shapes: kernels with quantized KV pages (every CPU
implementation agrees with the reference), quantized_matmul's forms, and sampling against a
copy of itself."""

from __future__ import annotations

import json

import pytest
from helpers import REPO

from jaxcb.bench.commands import main


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_kernels_quantized_pages(tmp_path, kv):
    out = tmp_path / "k.json"
    argv = ["--mixes", "decode", "--num-seqs", "2", "--kv-lens", "48", "--num-q-heads", "4",
            "--num-kv-heads", "2", "--head-dim", "32", "--repeats", "1", "--warmup", "0",
            "--kv-cache-dtype", kv, "--json", str(out)]  # fmt: skip
    assert main(["kernels", *argv]) == 0
    record = json.loads(out.read_text())
    assert record["args"]["kv_cache_dtype"] == kv and record["meta"]["platform"] == "cpu"
    rows = record["results"]
    assert {r["impl"] for r in rows} >= {"reference", "xla"}
    for r in rows:  # every implementation reads the same (quantized) pages as the reference
        assert r["max_abs_err"] < 1e-3 and r["ms"] > 0
    # ideal bytes: 1-byte codes + a 4-byte scale per row of 32 against bfloat16's 2 a value
    per_row = {"auto": 32 * 2, "int8": 32 + 4}[kv]
    ref = next(r for r in rows if r["impl"] == "reference")
    kv_bytes = 2 * 2 * 48 * 2 * per_row
    q_bytes = 2 * 2 * 4 * 32 * 2  # q in, out out
    assert ref["gb_per_s"] * ref["ms"] * 1e6 == pytest.approx(kv_bytes + q_bytes, rel=1e-6)


def test_quantized_matmul_forms(tmp_path, capsys):
    out = tmp_path / "m.json"
    # (--iters: the old spelling of --repeats, still accepted)
    argv = ["--rows", "1,4", "--hidden", "64", "--intermediate", "96", "--heads", "2",
            "--kv-heads", "1", "--head-dim", "32", "--layers", "2", "--iters", "1",
            "--json", str(out)]  # fmt: skip
    assert main(["quantized_matmul", *argv]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["form"], r["rows"]) for r in rows] == [
        (f, t) for f in ("bf16", "int8", "int8_channel", "fp8") for t in (1, 4)
    ]
    nbytes = {r["form"]: r["weight_bytes"] for r in rows}
    weights = 64 * 128 + 64 * 64 + 64 * 192 + 96 * 64
    assert nbytes["bf16"] == 2 * weights
    assert nbytes["int8_channel"] < nbytes["int8"] < nbytes["bf16"]  # groups carry a min too
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["vs_bf16"] == 1.0 for r in rows if r["form"] == "bf16")
    assert json.loads(out.read_text())["args"]["repeats"] == 1
    with pytest.raises(SystemExit):
        main(["quantized_matmul", "--forms", "int4"])
    assert "unknown --forms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantized_matmul", "--repeats", "0"])
    assert "--repeats: must be >= 1" in capsys.readouterr().err


def test_sampling_against_a_copy_of_itself(tmp_path):
    """--baseline times another sampling.py beside jaxcb's, calls interleaved: the same code
    draws the same tokens."""
    out = tmp_path / "s.json"
    argv = ["--vocabs", "256", "--rows", "4", "--mixes", "top_p,top_k", "--repeats", "2",
            "--warmup", "0", "--baseline", str(REPO / "jaxcb" / "sampling.py"),
            "--json", str(out)]  # fmt: skip
    assert main(["sampling", *argv]) == 0
    points = json.loads(out.read_text())["results"]
    assert [(p["vocab"], p["mix"]) for p in points] == [(256, "top_p"), (256, "top_k")]
    for p in points:
        assert p["same_tokens"] and p["new_ms"] > 0 and p["old_ms"] > 0
