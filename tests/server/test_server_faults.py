"""Fault isolation in the server, in-process (faults cannot be provoked in a healthy server
process on demand): a request the engine fails is an error for its client only; a broken
engine turns /health to 503 with the reason and refuses new work instead of dying silently."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from jaxcb import SamplingParams
from jaxcb.server import ServerSettings, build_app
from jaxcb.server.engine_loop import MAX_CONSECUTIVE_STEP_FAILURES

POISON = [9, 9, 9]  # prompts starting with these fail inside the engine
BODY = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def app_client(reference_llm):
    """The app on the reference engine (borrowed: the loop stops when the test ends)."""
    app = build_app(reference_llm.engine, ServerSettings(served_model_names=("tiny",)))
    with TestClient(app) as client:
        yield app, client
    assert reference_llm.engine.pool.num_used == 0


@pytest.fixture
def healthy_reference(reference_llm):
    """Offline tokens for the healthy request, computed before the app borrows the engine:
    while the app's loop thread owns it, nothing else may step it."""
    return reference_llm.generate(
        [[5, 6, 7, 8]],
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]


def test_a_failing_request_is_an_error_for_its_client_only(
    healthy_reference, app_client, reference_llm, monkeypatch
):
    _, client = app_client
    processor = reference_llm.engine.output_processor
    real = processor.append_sample

    def append_sample(req, group, result, s, now):
        if req.prompt_token_ids[:3] == POISON and req.output_token_ids:
            raise RuntimeError("detokenizer exploded")
        return real(req, group, result, s, now)

    monkeypatch.setattr(processor, "append_sample", append_sample)
    healthy = {**BODY, "prompt": [5, 6, 7, 8], "max_tokens": 40, "stream": True}
    with client.stream("POST", "/v1/completions", json=healthy) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # while that one streams, two poisoned requests fail
        answer = client.post("/v1/completions", json={**BODY, "prompt": [*POISON, 4]})
        assert answer.status_code == 500
        assert "detokenizer exploded" in answer.json()["error"]["message"]
        with client.stream(
            "POST", "/v1/completions", json={**BODY, "prompt": [*POISON, 5], "stream": True}
        ) as bad:
            events = [line[6:] for line in bad.iter_lines() if line.startswith("data: ")]
        assert "detokenizer exploded" in json.loads(events[-2])["error"]["message"]
        assert events[-1] == "[DONE]"
        rest = [first] + [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in rest[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    want = healthy_reference
    monkeypatch.undo()
    assert text == want.text and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert client.get("/health").status_code == 200


def test_steps_that_keep_failing_make_the_server_unhealthy(app_client, reference_llm, caplog):
    _, client = app_client
    engine = reference_llm.engine
    real_step = engine.step
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device on fire"))
    try:
        with caplog.at_level(logging.ERROR, logger="jaxcb.server.engine_loop"):
            for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
                answer = client.post("/v1/completions", json={**BODY, "prompt": "hi"})
                assert answer.status_code == 500
                assert "device on fire" in answer.json()["error"]["message"]
            health = client.get("/health")
            assert health.status_code == 503
            assert "steps failed in a row" in health.json()["error"]["message"]
            answer = client.post("/v1/completions", json={**BODY, "prompt": "hi"})
            assert answer.status_code == 503
        assert "the engine is broken" in caplog.text and "device on fire" in caplog.text
    finally:
        engine.step = real_step


def test_a_step_that_breaks_the_engine_is_fatal_at_once(app_client, reference_llm):
    _, client = app_client
    engine = reference_llm.engine
    real_step, real_check = engine.step, engine.check_health

    def lost():
        raise RuntimeError("the device KV cache was lost in a failed step")

    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("XLA runtime error"))
    engine.check_health = lost
    try:
        answer = client.post("/v1/completions", json={**BODY, "prompt": "hi", "stream": True})
        assert "XLA runtime error" in answer.text
        health = client.get("/health")
        assert health.status_code == 503 and "KV cache was lost" in health.text
    finally:
        engine.step, engine.check_health = real_step, real_check


def test_a_dying_loop_is_never_silent(app_client, caplog):
    """A bug in the loop itself ends its thread: the request in flight fails, /health and new
    requests answer 503 with the cause, and the log has the traceback."""
    app, client = app_client
    loop = app.state.engine_loop

    def broken_step():
        raise RuntimeError("loop bug")

    loop._step = broken_step
    with caplog.at_level(logging.ERROR, logger="jaxcb.server.engine_loop"):
        answer = client.post("/v1/completions", json={**BODY, "prompt": "hi"})
        assert answer.status_code == 500 and "loop bug" in answer.json()["error"]["message"]
        loop._thread.join(10)
        health = client.get("/health")
        assert health.status_code == 503 and "loop bug" in health.json()["error"]["message"]
        assert client.post("/v1/completions", json={**BODY, "prompt": "hi"}).status_code == 503
    assert "the engine loop died" in caplog.text
