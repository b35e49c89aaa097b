"""`python -m jaxcb.bench offline` end to end on a tiny model, and its workload / system
helpers."""

from __future__ import annotations

import json

import pytest
from helpers import make_hf_model

from jaxcb.bench.commands import main
from jaxcb.bench.offline_systems import parse_variant
from jaxcb.bench.systems import check_lengths
from jaxcb.bench.workloads import REFERENCE_VOCAB, BenchRequest, make_workload


def test_offline_mixed_matches_benchmarks_md():
    w = make_workload("offline-mixed")
    assert (len(w.requests), w.prompt_tokens, w.output_tokens) == (128, 16755, 9282)
    assert all(16 <= len(r.prompt_token_ids) <= 256 for r in w.requests)
    assert all(16 <= r.max_tokens <= 128 for r in w.requests)
    assert all(1 <= t < REFERENCE_VOCAB for r in w.requests for t in r.prompt_token_ids)


def test_fewer_requests_are_a_prefix_and_a_small_vocab_keeps_lengths():
    full = make_workload("offline-mixed")
    few = make_workload("offline-mixed", num_requests=5, vocab_size=512)
    for a, b in zip(full.requests, few.requests, strict=False):
        assert len(a.prompt_token_ids) == len(b.prompt_token_ids)
        assert a.max_tokens == b.max_tokens
    assert all(1 <= t < 512 for r in few.requests for t in r.prompt_token_ids)


def test_offline_long_and_bad_names():
    w = make_workload("offline-long")
    assert len(w.requests) == 32 and {r.max_tokens for r in w.requests} == {64}
    assert all(512 <= len(r.prompt_token_ids) <= 1536 for r in w.requests)
    assert w.max_seq_len <= 1600
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("offline-mixed", num_requests=0)


def test_check_lengths_rejects_early_stops():
    requests = [BenchRequest([1, 2], 3), BenchRequest([3], 2)]
    check_lengths("x", [[5, 6, 7], [8, 9]], requests)
    with pytest.raises(RuntimeError, match="exactly max_tokens"):
        check_lengths("x", [[5, 6, 7], [8]], requests)


def test_bad_systems_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["offline", "--systems", "jaxcb,vllm-typo"])
    assert "unknown --systems ['vllm-typo']" in capsys.readouterr().err


def test_variant_flag_parses_and_rejects_bad_forms():
    """--variant NAME:FIELD=V,...: another jaxcb row with some config fields changed."""
    assert parse_variant("swap:preemption_mode=swap,swap_space_gb=2") == (
        "swap",
        {"preemption_mode": "swap", "swap_space_gb": "2"},
    )
    for bad in ("swap", "swap:", ":a=b", "swap:preemption_mode"):
        with pytest.raises(ValueError, match="--variant"):
            parse_variant(bad)
    with pytest.raises(SystemExit):
        main(["offline", "--systems", "hf-cb", "--variant", "swap:preemption_mode=swap"])
    with pytest.raises(SystemExit):
        main(["offline", "--variant", "swap"])


def test_offline_writes_json(tmp_path):
    model_dir = tmp_path / "tiny"
    make_hf_model("llama3", model_dir)
    out = tmp_path / "bench.json"
    # A small jaxcb config keeps compilation short; the tiny model's vocab (512) folds the ids.
    argv = ["--model", str(model_dir), "--num-requests", "4", "--systems", "jaxcb,hf-cb",
            "--repeats", "2", "--warmup-requests", "1", "--no-roofline", "--json", str(out),
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets",
            "16,32,64", "--num-pages", "128"]  # fmt: skip
    assert main(["offline", *argv]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "offline" and record["args"]["systems"] == ["jaxcb", "hf-cb"]
    assert record["machine"]["cores"] >= 1

    assert record["workload"]["num_requests"] == 4
    assert record["workload"]["output_tokens"] == sum(
        r.max_tokens for r in make_workload("offline-mixed", num_requests=4).requests
    )
    assert set(record["systems"]) == {"jaxcb", "hf-cb"}
    assert len(record["systems"]["jaxcb"]["passes"]) == 2
    assert len(record["systems"]["hf-cb"]["passes"]) == 1
    jaxcb_pass = record["systems"]["jaxcb"]["passes"][0]
    assert jaxcb_pass["steps"] > 0 and jaxcb_pass["preemptions"] == 0
    assert 0 <= jaxcb_pass["padding_fraction"] < 1
    assert jaxcb_pass["tokens_scheduled"] <= jaxcb_pass["token_slots"]
    info = record["systems"]["jaxcb"]["info"]
    assert info["compile_seconds"] > 0 and info["config"]["scheduler"]["max_num_seqs"] == 8
    medians = {m["system"]: m for m in record["medians"]}
    for m in medians.values():
        assert m["wall_s"] > 0 and m["output_tok_s"] > 0 and m["total_tok_s"] > m["output_tok_s"]
        assert m["mfu"] is None  # --no-roofline
    # float32, same weights: greedy tokens agree (allow one near-tie among 4 requests)
    assert record["agreement_with_jaxcb"]["hf-cb"]["identical_fraction"] >= 0.75
    env = record["environment"]
    assert env["versions"]["jax"] and env["versions"]["transformers"] and env["cpu_count"] >= 1
