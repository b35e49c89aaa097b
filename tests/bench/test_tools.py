"""The batching benchmarks on the tiny model: sweep_buckets (two bucket sets),
compare_batching, offline's trace and shared-prefix workload, and the vLLM system's
subprocess protocol (driven by a stand-in runner, so no vLLM is needed)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from jaxcb.bench.commands import main
from jaxcb.bench.commands.sweep_buckets import bucket_set, recommend
from jaxcb.bench.systems import BenchContext, VLLMSystem, vllm_environment
from jaxcb.bench.workloads import make_workload
from jaxcb.models.loading.default_model import default_model_dir

SMALL = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-pages", "160",
         "--warmup-requests", "1"]  # fmt: skip


def test_bucket_sets():
    assert bucket_set("pow2", 256) == (16, 32, 64, 128, 256)
    assert bucket_set("geo1.5", 256) == (16, 24, 40, 64, 96, 144, 216, 256)
    assert bucket_set("step", 256) == (32, 64, 96, 128, 160, 192, 224, 256)
    assert bucket_set("step64", 256) == (64, 128, 192, 256)
    assert bucket_set("single", 256) == (256,)
    assert bucket_set("16/64/256", 256) == (16, 64, 256)
    for bad in ("16/64", "geo0.9", "stepx", "nope"):
        with pytest.raises(ValueError):
            bucket_set(bad, 256)


def test_sweep_buckets_two_sets(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--model", str(default_model_dir()), "--num-requests", "3", "--sets", "pow2,single",
            "--json", str(out), "--png", str(png), *SMALL]  # fmt: skip
    assert main(["sweep_buckets", *argv]) == 0
    record = json.loads(out.read_text())
    rows = {r["name"]: r for r in record["results"]}
    assert rows["pow2"]["buckets"] == [16, 32] and rows["single"]["buckets"] == [32]
    for r in rows.values():
        assert r["compile_seconds"] > 0 and r["output_tok_s"] > 0 and r["mean_ttft_ms"] > 0
        assert 0 <= r["padding_fraction"] < 1
    # a single bucket pads at least as much as a set that contains it
    assert rows["single"]["padding_fraction"] >= rows["pow2"]["padding_fraction"]
    assert record["recommended"] in rows
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_recommend_prefers_fast_compiles_among_ties():
    rows = [
        dict(name="a", buckets=[8], output_tok_s=100.0, compile_seconds=9.0),
        dict(name="b", buckets=[8], output_tok_s=97.0, compile_seconds=2.0),
        dict(name="c", buckets=[8], output_tok_s=80.0, compile_seconds=1.0),
    ]
    assert recommend(rows, 0.05)[0]["name"] == "b"
    assert recommend(rows, 0.0)[0]["name"] == "a"


def test_compare_batching(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    argv = ["--model", str(default_model_dir()), "--num-requests", "6", "--json", str(out),
            "--png", str(png), "--trace-dir", str(tmp_path / "traces"), "--token-buckets",
            "16,32", *SMALL]  # fmt: skip
    assert main(["compare_batching", *argv]) == 0
    record = json.loads(out.read_text())
    assert record["greedy_tokens_identical"]
    rows = {r["batching"]: r for r in record["results"]}
    assert set(rows) == {"static", "dynamic", "continuous"}
    assert rows["continuous"]["batch_padding_tokens"] == 0
    assert (
        rows["static"]["batch_padding_tokens"] > 0 and rows["dynamic"]["batch_padding_tokens"] > 0
    )
    assert rows["static"]["padding_tokens"] > rows["continuous"]["padding_tokens"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    for mode in rows:
        assert (tmp_path / "traces" / f"trace-{mode}.png").is_file()
    assert "greedy tokens identical across modes: yes" in capsys.readouterr().out


def test_offline_trace_and_shared_prefix(tmp_path):
    w = make_workload("shared-prefix")
    assert (len(w.requests), w.output_tokens) == (64, 64 * 64)
    assert len({tuple(r.prompt_token_ids[:512]) for r in w.requests}) == 1
    assert all(528 <= len(r.prompt_token_ids) <= 576 for r in w.requests)

    trace = tmp_path / "trace.json"
    argv = ["--model", str(default_model_dir()), "--workload", "shared-prefix", "--num-requests",
            "3", "--systems", "jaxcb", "--repeats", "1", "--no-roofline", "--trace", str(trace),
            "--token-buckets", "16,32", *SMALL]  # fmt: skip
    assert main(["offline", *argv]) == 0
    steps = json.loads(trace.read_text())["steps"]
    # the pass after the cache reset prefills the shared prefix once and hits it twice
    assert sum(s["prefix_hits"] for s in steps) >= 2 * 512 - 32


# ---- vLLM's subprocess protocol, with a stand-in for vllm_runner.py ---------------------

FAKE_RUNNER = textwrap.dedent(
    """
    import json, sys
    args = sys.argv[sys.argv.index("--requests") + 1]
    spec = json.load(open(args))
    print(json.dumps({"event": "ready", "version": "fake", "load_s": 0.1, "warmup_s": 0.0}))
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        ids = [[7] * m for m in spec["max_tokens"]]
        print(json.dumps({"event": "pass", "wall_s": 0.5, "token_ids": ids}))
        sys.stdout.flush()
    """
)


def test_vllm_system_protocol(tmp_path):
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    python = tmp_path / "python"
    # stands in for the venv's python: runs the fake runner whatever script it is given
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {runner} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    workload = make_workload("offline-mixed", num_requests=3)
    ctx = BenchContext(
        model_dir=tmp_path, workload=workload, dtype="float32", log=lambda m: None,
        vllm_python=python, vllm_binding="default",
    )  # fmt: skip
    system = VLLMSystem(ctx)
    try:
        result = system.run_pass()
        assert result.wall_s == 0.5
        assert [len(t) for t in result.token_ids] == [r.max_tokens for r in workload.requests]
        assert system.info()["version"] == "fake"
        assert system.proc.args[-1] == "1024"  # --max-model-len: capped by the model
    finally:
        system.close()
    assert system.proc.returncode == 0

    env = vllm_environment(python, "default")
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "LD_PRELOAD" not in env
    with pytest.raises(RuntimeError, match="libiomp5"):
        vllm_environment(python, "tuned")
    with pytest.raises(ValueError, match="--vllm-python"):
        VLLMSystem(BenchContext(model_dir=tmp_path, workload=workload, dtype="float32"))


@pytest.mark.parametrize("name", ["plot_trace", "sweep_buckets", "compare_batching"])
def test_a_plotting_benchmark_without_matplotlib_stops_at_once_in_one_line(
    name, tmp_path, monkeypatch, capsys
):
    """matplotlib is optional (the bench extra): a benchmark that would plot says so before
    it starts its passes, naming the pip command, with no traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"format": "jaxcb-step-trace-v1", "meta": {}, "steps": []}))
    argv = [str(trace)] if name == "plot_trace" else []
    with pytest.raises(SystemExit) as exit_:
        main([name, *argv])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.endswith('plots need matplotlib: pip install "jaxcb[bench]"'), line
