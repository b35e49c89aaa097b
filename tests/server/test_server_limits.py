"""A second server with an API key, two served names and a one-request queue: 401, 404, 429,
and a graceful SIGTERM (the running request ends, the process exits 0)."""

from __future__ import annotations

import json
import signal
import socket

import pytest
from server_helpers import (
    ENGINE_CONFIG,
    metric,
    open_raw_request,
    read_events,
    request,
    sse_payloads,
    wait_for_metrics,
    wait_idle,
)

KEY = "sekret-key"
NAMES = ["tiny", "tiny-alias"]
CONFIG = {**ENGINE_CONFIG, "max_num_seqs": 1}
ARGS = [
    *(a for k, v in CONFIG.items() for a in (f"--{k.replace('_', '-')}", str(v))),
    *("--api-key", KEY, "--served-model-name", *NAMES),
    *("--max-waiting-requests", "1", "--shutdown-timeout", "0.5"),
]
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_tokens": 500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def limited(start_server):
    with start_server(ARGS) as srv:
        yield srv


def _raw(server, body: dict) -> socket.socket:
    return open_raw_request(server, "/v1/completions", body, headers=AUTH)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}],
    ids=["none", "wrong", "no-scheme", "basic"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")],
)
def test_api_key_is_required_on_v1(limited, headers, method, path):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2} if method == "POST" else None
    status, answer = request(method, limited.url + path, body, headers=headers)
    assert status == 401
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_right_key_works_and_health_metrics_are_open(limited):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == NAMES
    out = client.completions.create(model="tiny-alias", prompt="hi", max_tokens=3)
    assert out.model == "tiny-alias" and len(out.choices) == 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="jaxcb-tiny-random-llama-v1", prompt="hi", max_tokens=3)
    bad = openai.OpenAI(base_url=limited.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert request("GET", limited.url + "/health")[0] == 200
    assert request("GET", limited.url + "/metrics")[0] == 200


def _aborted(samples: dict) -> float:
    return metric(samples, "jaxcb:request_success_total", finished_reason="abort")


def test_full_queue_answers_429_and_a_waiting_request_can_leave(limited):
    """max_num_seqs=1, --max-waiting-requests 1: one runs, one waits, the third gets 429.
    The waiting one's client then disconnects: it leaves the queue at once."""
    before = wait_idle(limited.url)
    running = _raw(limited, {"model": "tiny", "prompt": "a", "stream": True, **LONG})
    assert read_events(running, 2).startswith(b"HTTP/1.1 200")
    waiting = _raw(limited, {"model": "tiny", "prompt": "b", "stream": True, **LONG})
    wait_for_metrics(limited.url, lambda s: metric(s, "jaxcb:num_requests_waiting") == 1)

    status, answer = request(
        "POST", limited.url + "/v1/completions", {"model": "tiny", "prompt": "c"}, headers=AUTH
    )
    assert status == 429
    assert set(answer["error"]) == {"message", "type", "param", "code"}

    waiting.close()
    samples = wait_for_metrics(limited.url, lambda s: _aborted(s) == _aborted(before) + 1)
    assert metric(samples, "jaxcb:num_requests_waiting") == 0
    assert metric(samples, "jaxcb:num_requests_running") == 1  # the other one is unaffected
    running.close()
    after = wait_idle(limited.url)
    assert _aborted(after) == _aborted(before) + 2


def test_sigterm_drains_and_exits_0(limited):
    """Runs last in this module: it ends the server."""
    wait_idle(limited.url)
    stream = _raw(limited, {"model": "tiny", "prompt": "a", "stream": True, **LONG})
    head = read_events(stream, 2)
    assert head.startswith(b"HTTP/1.1 200")
    limited.proc.send_signal(signal.SIGTERM)
    payloads = sse_payloads(head + read_events(stream))  # to the end of the response
    stream.close()
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert last["choices"][0]["finish_reason"] in ("abort", "length")
    assert limited.proc.wait(60) == 0
    assert "draining" in limited.log()
    with pytest.raises(OSError):
        socket.create_connection(limited.host_port, timeout=5)
