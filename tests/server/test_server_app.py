"""In-process checks of paths a healthy server process cannot be pushed into on demand:
draining (503), an engine step that fails (500, and the loop carries on), and the
coalescing mailbox between the engine thread and a slow client."""

from __future__ import annotations

import asyncio
import json

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
    assert model["id"] == "tiny" and model["root"] == str(engine.model_path)


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
