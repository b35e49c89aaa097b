"""The ITL controller in a real engine (the built-in tiny model, CPU): each step's token
budget is one of the compiled buckets, so nothing is traced again after warm-up; decodes
always fit and the floor's prefill too; the budget shows in the step trace, its plot,
stats() and /metrics; and the tokens are those of the fixed budget.

An ITL target of 1 microsecond is never met, so the controller cuts the budget from the
largest bucket to the smallest within a few steps whatever the machine's speed (the rise on
headroom is timing-dependent: tests/engine/test_itl_controller.py drives it with synthetic
latencies)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_MODEL, traced_programs

from jaxcb import LLM, SamplingParams
from jaxcb.engine.step_trace import recording, save_trace, trace_meta
from jaxcb.runtime import step as step_module

BUCKETS = (16, 32, 64)
MIN_PREFILL = 4
CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=list(BUCKETS),
    max_model_len=256,
    page_size=8,
    num_pages=128,
    itl_target_ms=0.001,
    itl_window=8,
    itl_min_prefill_tokens=MIN_PREFILL,
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    traces = step_module.TRACE_COUNT[0]
    engine = LLM(**CONFIG)
    # a step per bucket and a sampling program per sequence-row count
    assert step_module.TRACE_COUNT[0] - traces == traced_programs(engine.engine.info.buckets)
    return engine


def run(llm: LLM, seed: int) -> tuple[dict[str, list[int]], list[dict]]:
    """Short prompts decode while long ones (several chunks each) arrive among them; the
    page invariant after every step. Returns each request's tokens and the step records."""
    rng = np.random.default_rng(seed)
    engine = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    short = [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(2, 12, size=5)]
    long = [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(100, 180, size=3)]
    tokens: dict[str, list[int]] = {}
    with recording(llm) as steps:
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, params)
        step = 0
        while engine.has_unfinished_requests():
            if step in (4, 10, 16):  # a long prompt each time, decodes running
                engine.add_request(f"l{step}", long[(step - 4) // 6], params)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            engine.check_page_invariant()
            step += 1
    assert engine.pool.num_used == 0
    return tokens, steps


def test_budget_from_buckets_only_no_recompilation_same_tokens(llm, tmp_path):
    traces = step_module.TRACE_COUNT[0]
    tokens, steps = run(llm, seed=0)
    assert step_module.TRACE_COUNT[0] == traces, "the step function was traced again"
    assert set(llm.stats()["bucket_histogram"]) <= set(BUCKETS)

    budgets = [s["token_budget"] for s in steps]
    assert set(budgets) <= set(BUCKETS)
    assert budgets[0] == 64 and 16 in budgets  # started at the largest, cut to the smallest
    assert llm.stats()["prefill_budget"] == 16
    for s in steps:
        decodes = sum(1 for _, n, kind in s["chunks"] if kind == "decode")
        prefill = s["num_tokens"] - decodes
        assert s["bucket"] <= s["token_budget"] and s["num_tokens"] <= s["token_budget"]
        if decodes:  # the floor: the decodes and MIN_PREFILL prefill tokens always fit
            assert s["token_budget"] >= min(decodes + MIN_PREFILL, BUCKETS[-1])
            assert prefill <= s["token_budget"] - decodes
    # long prompts among decodes were chunked by the small budget, and still went through
    assert any(kind == "prefill" and n > 1 for s in steps[5:] for _, n, kind in s["chunks"])
    assert set(tokens) == {f"s{i}" for i in range(5)} | {"l4", "l10", "l16"}

    # the fixed budget gives the same greedy tokens, only chunked differently
    llm.engine.reset_prefix_cache()  # so the prompts are computed again, not found cached
    controller, llm.engine.itl = llm.engine.itl, None
    try:
        fixed, fixed_steps = run(llm, seed=0)
    finally:
        llm.engine.itl = controller
    assert fixed == tokens
    assert {s["token_budget"] for s in fixed_steps} == {64}
    assert step_module.TRACE_COUNT[0] == traces

    # the trace keeps the budget and the target; its plot draws them
    path = save_trace(tmp_path / "trace.json", steps, trace_meta(llm))
    from jaxcb.bench.plots import plot_trace
    from jaxcb.engine.step_trace import load_trace

    loaded = load_trace(path)
    assert loaded["meta"]["itl_target_ms"] == CONFIG["itl_target_ms"]
    assert [s["token_budget"] for s in loaded["steps"]] == budgets
    assert plot_trace(loaded, tmp_path / "trace.png").stat().st_size > 0


def test_metrics_gauge_shows_the_step_budget(llm):
    from prometheus_client.parser import text_string_to_metric_families

    from jaxcb.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", BUCKETS)
    llm.engine.record_steps(True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    records = llm.engine.pop_step_records()
    llm.engine.record_steps(False)
    for record in records:
        metrics.step(record)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (sample,) = families["jaxcb:prefill_budget_tokens"].samples
    assert sample.value == records[-1].token_budget and sample.value in BUCKETS


def test_server_writes_the_budget_in_its_step_trace(llm, tmp_path):
    """serve.py --step-trace: the app keeps every step's record and writes the trace on
    shutdown; /metrics has the budget gauge (in-process, on this module's engine)."""
    from starlette.testclient import TestClient

    from jaxcb.engine.step_trace import load_trace
    from jaxcb.server import ServerSettings, build_app

    path = tmp_path / "served.json"
    app = build_app(llm.engine, ServerSettings(served_model_names=("tiny",), step_trace=path))
    body = {"model": "tiny", "prompt": list(range(5, 105)), "max_tokens": 8, "ignore_eos": True}
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        metrics = client.get("/metrics").text
    assert 'jaxcb:prefill_budget_tokens{model_name="tiny"}' in metrics
    trace = load_trace(path)
    assert trace["meta"]["served"] is True and trace["meta"]["itl_target_ms"] == 0.001
    assert len(trace["steps"]) >= 8
    assert {s["token_budget"] for s in trace["steps"]} <= set(BUCKETS)
    assert llm.engine.pool.num_used == 0
