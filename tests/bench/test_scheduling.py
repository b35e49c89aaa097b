"""`python -m jaxcb.bench scheduling`: `order` end to end on a tiny model (one engine, three
orders), and its flag checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_hf_model

from jaxcb.bench.commands import main
from jaxcb.bench.passage_questions import passage_questions


def test_order_writes_json_with_identical_tokens(tmp_path):
    model_dir = tmp_path / "tiny"
    make_hf_model("llama3", model_dir)
    out = tmp_path / "order.json"
    argv = ["order", "--model", str(model_dir), "--source", "random", "--num-passages", "3",
            "--num-questions", "3", "--passage-tokens", "24,40", "--output-len", "2,6",
            "--warmup-requests", "1", "--json", str(out), "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--token-buckets", "32", "--page-size", "8",
            "--num-pages", "96"]  # fmt: skip
    assert main(["scheduling", *argv]) == 0
    record = json.loads(out.read_text())
    assert record["knob"] == "order" and record["workload"]["num_requests"] == 9
    rows = {r["variant"]: r for r in record["summary"]}
    assert list(rows) == ["arrival", "auto", "prefix"]
    for row in rows.values():
        assert row["different_requests"] == 0 and row["output_tok_s"] > 0
        assert row["output_tokens"] == record["workload"]["output_tokens"]
        assert 0 < row["prefill_computed"] <= record["workload"]["prompt_tokens"]
    assert rows["arrival"]["speedup"] == 1.0
    # held back until their passage is cached, the questions compute only their own tokens
    assert rows["auto"]["prefill_computed"] == rows["prefix"]["prefill_computed"]
    assert rows["auto"]["prefill_computed"] <= rows["arrival"]["prefill_computed"]
    assert record["engines"]["engine"]["kv_pages_total"] == 96


def test_bad_flags_are_errors(capsys):
    for argv, message in (
        (["order", "--variants", "arrival,lifo"], "unknown --variants ['lifo']"),
        (["swap", "--variants", "recompute,arrival"], "unknown --variants ['arrival']"),
        (["admission", "--repeats", "0"], "--repeats: must be >= 1"),
        (["nope"], "invalid choice: 'nope'"),
        (["order", "--workload", "chat-fixed"], "--workload and --num-requests are admission"),
        (["swap", "--num-passages", "4"], "--num-passages: order's flags, not swap's"),
        (["admission", "--pool-fraction", "0"], "--pool-fraction must be > 0"),
    ):
        with pytest.raises(SystemExit):
            main(["scheduling", *argv])
        assert message in capsys.readouterr().err


def test_passage_questions_share_each_passage():
    w = passage_questions(Path("."), num_passages=3, num_questions=4, source="random", seed=3)
    assert len(w.requests) == 12
    prefixes = {tuple(r.prompt_token_ids[:24]) for r in w.requests}  # passages >= 256 tokens
    assert len(prefixes) == 3
    order = [tuple(r.prompt_token_ids[:24]) for r in w.requests]
    assert order != sorted(order, key=order.index)  # shuffled: not grouped already
    assert all(16 <= r.max_tokens <= 256 for r in w.requests)
    with pytest.raises(ValueError, match="num_questions"):
        passage_questions(Path("."), num_passages=1, num_questions=99, source="random")
