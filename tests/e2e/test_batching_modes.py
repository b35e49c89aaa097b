"""The batching baselines on the real engine (tiny model): identical greedy tokens in every
mode, the padding the formulas predict, and a step trace that records and plots."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.engine.step_trace import load_trace, recording, save_trace, summarize_trace, trace_meta

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[16, 32],
    max_model_len=128,
    num_pages=64,
    page_size=8,
)
# (prompt tokens, max_tokens). Request 0 finishes first; request 4 waits for its slot.
SHAPES = [(5, 3), (3, 12), (2, 12), (4, 12), (8, 2)]
B = CONFIG["max_num_seqs"]


def expected_padding(mode: str) -> int:
    first = SHAPES[:B]
    lmax, tmax = max(n for n, _ in first), max(t for _, t in first)
    left_pad = sum(lmax - n for n, _ in first)
    if mode == "static":  # batch 1 pads prompts and waits for its slowest; batch 2 is alone
        return left_pad + sum(tmax - t for _, t in first)
    n = SHAPES[B][0]  # dynamic: the refill of one n-token prompt into B rows
    return left_pad + (n - 1) * (B - 1)


@pytest.fixture(scope="module")
def runs():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=n).tolist() for n, _ in SHAPES]
    params = [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True) for _, t in SHAPES]
    out = {}
    for mode in ("continuous", "static", "dynamic"):
        llm = LLM(batching=mode, **CONFIG)
        with recording(llm) as steps:
            outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_page_invariant()
        out[mode] = dict(
            tokens=[o.outputs[0].token_ids for o in outs],
            steps=steps,
            stats=llm.stats(),
            meta=trace_meta(llm),
        )
    return out


def test_every_mode_yields_the_same_greedy_tokens(runs):
    reference = runs["continuous"]["tokens"]
    assert [len(t) for t in reference] == [t for _, t in SHAPES]
    assert len({tok for t in reference for tok in t}) > 5  # diverse output, not one token
    assert runs["static"]["tokens"] == reference
    assert runs["dynamic"]["tokens"] == reference


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_padding_matches_the_formula(runs, mode):
    run = runs[mode]
    summary = summarize_trace(run["steps"])
    assert summary["batch_padding_tokens"] == expected_padding(mode)
    assert run["meta"]["batching"] == mode and run["stats"]["preemptions"] == 0
    # stats() counts it with the bucket's rounding: all slots minus real tokens
    slots = sum(b * n for b, n in run["stats"]["bucket_histogram"].items())
    assert slots == summary["token_slots"]
    padding = slots * run["stats"]["padding_fraction"]
    assert padding == pytest.approx(summary["padding_tokens"])
    assert summary["padding_tokens"] >= summary["batch_padding_tokens"]


def test_continuous_has_no_batch_padding_and_fewer_steps(runs):
    cont = summarize_trace(runs["continuous"]["steps"])
    assert cont["batch_padding_tokens"] == 0
    assert cont["steps"] < summarize_trace(runs["static"]["steps"])["steps"]
    total_tokens = sum(n + t - 1 for n, t in SHAPES)  # every token but the last is fed
    for mode in runs:
        assert summarize_trace(runs[mode]["steps"])["tokens"] == total_tokens


def test_trace_labels_prefill_and_decode(runs):
    steps = runs["continuous"]["steps"]
    decode = sum(n for s in steps for _, n, kind in s["chunks"] if kind == "decode")
    prefill = sum(n for s in steps for _, n, kind in s["chunks"] if kind == "prefill")
    assert prefill == sum(n for n, _ in SHAPES)
    assert decode == sum(t - 1 for _, t in SHAPES)
    assert all(s["pages_used"] <= CONFIG["num_pages"] for s in steps)


def test_trace_saves_loads_and_plots(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from jaxcb.bench.plots import plot_trace

    path = save_trace(tmp_path / "t.json", runs["dynamic"]["steps"], runs["dynamic"]["meta"])
    trace = load_trace(path)
    assert trace["meta"]["kv_pages_total"] == CONFIG["num_pages"]
    png = plot_trace(trace, tmp_path / "t.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 500 and height > 300

    from jaxcb.bench.commands import main

    assert main(["plot_trace", str(path), "--steps", "2:", "-o", str(tmp_path / "z.png")]) == 0
    assert (tmp_path / "z.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["plot_trace", str(tmp_path / "bad.json")])
