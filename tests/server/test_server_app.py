"""In-process checks of paths a healthy server process cannot be pushed into on demand:
draining (503), an engine step that fails (500, and the loop carries on), and the
coalescing mailbox between the engine thread and a slow client."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.testclient import TestClient

from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.server import ServerSettings, build_app
from jaxcb.server.submission import EngineFailure, Submission

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}


@pytest.fixture
def app_client(reference_llm):
    """The app on the reference engine (borrowed: the loop stops when the test ends)."""
    app = build_app(reference_llm.engine, ServerSettings(served_model_names=("tiny",)))
    with TestClient(app) as client:
        yield app, client
    assert reference_llm.engine.pool.num_used == 0


def test_draining_answers_503(app_client):
    app, client = app_client
    assert client.post("/v1/completions", json=BODY).status_code == 200
    app.state.engine_loop.begin_drain(0.0)
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "shutting_down"
    assert client.get("/health").status_code == 503


def _answer(client: TestClient, body: dict) -> tuple[int, dict | None]:
    """Status and (for an error) body of a streaming request: headers come once it is
    admitted, so a request that was wrongly admitted fails the test instead of hanging it."""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
        if answer.status_code == 200:
            return 200, None
        return answer.status_code, json.loads(answer.read())


def test_a_request_s_whole_fan_out_counts_against_the_waiting_limit(
    app_client, reference_llm, monkeypatch
):
    """One request of 10,000 prompts, or of prompts x n, could fill the queue past the
    limit; now all its sequences must fit. Nothing is scheduled here, so all added wait."""
    app, client = app_client
    monkeypatch.setattr(app.state.engine_loop, "max_waiting_requests", 3)
    monkeypatch.setattr(reference_llm.engine, "step", lambda: [])
    sampled = {**BODY, "temperature": 1.0}
    with client.stream(
        "POST", "/v1/completions", json={**BODY, "prompt": ["a", "b"], "stream": True}
    ) as first:
        assert first.status_code == 200  # 2 sequences wait
        for body in ({**BODY, "prompt": ["c", "d"]}, {**sampled, "n": 2}):  # 2 + 2 > 3
            status, answer = _answer(client, body)
            assert status == 429 and answer["error"]["code"] == "queue_full", answer
            assert "adds 2" in answer["error"]["message"]
        for body, param in (({**BODY, "prompt": ["c"] * 4}, "prompt"), ({**sampled, "n": 4}, "n")):
            status, answer = _answer(client, body)  # can never fit: not worth a retry
            assert status == 400 and answer["error"]["param"] == param, answer
            assert "max_waiting_requests=3" in answer["error"]["message"]
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as third:
            assert third.status_code == 200  # 2 + 1 fits
    deadline = time.monotonic() + 10
    while reference_llm.engine.num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reference_llm.engine.num_waiting == 0  # the closed streams aborted theirs


def test_failed_step_is_a_500_and_the_loop_carries_on(app_client, reference_llm, monkeypatch):
    _, client = app_client
    engine = reference_llm.engine
    real_step, failures = engine.step, [RuntimeError("boom"), RuntimeError("bang")]

    def flaky_step():
        if failures:
            raise failures.pop(0)
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "server_error"
    assert "boom" in answer.json()["error"]["message"]

    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert "bang" in json.loads(events[0])["error"]["message"]
    assert events[-1] == "[DONE]"

    assert engine.pool.num_used == 0
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 4
    assert client.get("/health").status_code == 200


def test_show_model_path_puts_the_path_in_root(reference_llm):
    engine = reference_llm.engine
    settings = ServerSettings(served_model_names=("tiny",), show_model_path=True)
    with TestClient(build_app(engine, settings)) as client:
        (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "tiny" and model["root"] == engine.info.model_path


def _output(index: int, token_ids: list[int], finished: bool = False) -> RequestOutput:
    sample = CompletionOutput(0, "", token_ids, "length" if finished else None)
    out = RequestOutput(f"r-{index}", None, [1], [sample], finished)
    out.extra["token_texts"] = {t: str(t) for t in token_ids}
    return out


def test_mailbox_keeps_only_the_latest_output_per_prompt():
    async def run() -> None:
        box = Submission(["r-0", "r-1"])
        for n in range(1, 4):  # three steps before the client reads anything
            box._post(0, _output(0, list(range(n))))
        box._post(1, _output(1, [7], finished=True))
        news = await box.updates()
        assert sorted(news) == [0, 1]
        assert news[0].outputs[0].token_ids == [0, 1, 2]
        assert box.token_texts == {0: "0", 1: "1", 2: "2", 7: "7"}
        box._post(0, EngineFailure("gone"))
        with pytest.raises(EngineFailure):
            await box.updates()

    asyncio.run(run())


class _NoJinjaTokenizer:
    """The engine's tokenizer as a bare install without jinja2 left it: chat templates fail
    to render with transformers' ImportError."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2 to be installed.")


def test_a_server_that_cannot_render_chat_templates_refuses_to_start(reference_llm, monkeypatch):
    from jaxcb.server import prompts

    real = prompts.own_tokenizer
    monkeypatch.setattr(prompts, "own_tokenizer", lambda engine: _NoJinjaTokenizer(real(engine)))
    with pytest.raises(ValueError, match=r"chat requests cannot be served: .*jinja2"):
        build_app(reference_llm.engine, ServerSettings(served_model_names=("tiny",)))


def test_a_chat_template_that_cannot_render_is_the_server_s_error(app_client, monkeypatch):
    """Should rendering fail for want of a package after start-up, the client hears 500,
    not a 400 that blames its messages."""
    app, client = app_client
    encoder = app.state.encoder
    monkeypatch.setattr(encoder, "tokenizer", _NoJinjaTokenizer(encoder.tokenizer))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["type"] == "server_error"
    assert "jinja2" in answer.json()["error"]["message"]
