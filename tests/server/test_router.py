"""jaxcb/server/router.py: the router answers streaming and not through its replicas, routes
equal prefixes together, skips a dead replica and merges /metrics. The replicas here are small
fake OpenAI servers (each says which it is), so routing is tested without engines; loopback
only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxcb.server.router import Router, build_router_app, merge_metrics, prefix_key


def fake_replica(index: int) -> FastAPI:
    app = FastAPI()
    served = {"n": 0}

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = (
            "# HELP jaxcb:prefix_cache_hits_total hits\n"
            "# TYPE jaxcb:prefix_cache_hits_total counter\n"
            f'jaxcb:prefix_cache_hits_total{{model_name="m"}} {10 * index + 1}\n'
            f"# HELP served served\n# TYPE served gauge\nserved {served['n']}\n"
        )
        return Response(text, media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        served["n"] += 1
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": f"r{index}"}], "replica": index})

        async def events() -> AsyncIterator[bytes]:
            for piece in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode()
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(app: FastAPI, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return server


def post(url: str, body: dict) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        return dict(response.headers), response.read()


@pytest.fixture(scope="module")
def routed() -> Iterator[tuple[str, Router, list[int]]]:
    """Two live fake replicas and one dead port behind a prefix router."""
    ports = [free_port() for _ in range(3)]
    servers = [serve_in_thread(fake_replica(i), ports[i]) for i in range(2)]
    router = Router([("127.0.0.1", p) for p in ports], policy="prefix", prefix_tokens=8)
    router_port = free_port()
    servers.append(serve_in_thread(build_router_app(router, health_interval=0.2), router_port))
    yield f"http://127.0.0.1:{router_port}", router, ports
    for server in servers:
        server.should_exit = True


def test_non_streaming_and_streaming(routed: tuple[str, Router, list[int]]) -> None:
    url, _, _ = routed
    headers, data = post(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})
    assert json.loads(data)["choices"][0]["text"] in ("r0", "r1")
    assert headers["x-jaxcb-replica"] in ("0", "1")
    _, data = post(url + "/v1/completions", {"prompt": [1, 2, 3], "stream": True})
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "abc"


def test_equal_prefixes_go_together_and_dead_replica_is_skipped(
    routed: tuple[str, Router, list[int]],
) -> None:
    url, router, _ = routed
    for group in range(6):
        shared = [100 + group] * 8  # the first prefix_tokens ids: the routing key
        replicas = {
            post(url + "/v1/completions", {"prompt": [*shared, k], "max_tokens": 1})[0][
                "x-jaxcb-replica"
            ]
            for k in range(4)
        }
        assert len(replicas) == 1  # one replica per prefix, never the dead one (2)
        assert replicas <= {"0", "1"}
    assert not router.replicas[2].healthy
    assert {r.routed > 0 for r in router.replicas[:2]} == {True}  # both used
    text = "{" + '"messages": [{"role": "user", "content": "hi"}]' + "}"
    assert prefix_key(json.loads(text), 8) == prefix_key(json.loads(text), 8)


def test_metrics_are_labelled_by_replica(routed: tuple[str, Router, list[int]]) -> None:
    url, _, _ = routed
    with urllib.request.urlopen(url + "/metrics", timeout=20) as response:
        text = response.read().decode()
    assert 'jaxcb:prefix_cache_hits_total{replica="0",model_name="m"} 1' in text
    assert 'jaxcb:prefix_cache_hits_total{replica="1",model_name="m"} 11' in text
    assert text.count("# TYPE jaxcb:prefix_cache_hits_total counter") == 1
    assert "jaxcb_router_routed_total" in text
    merged = merge_metrics(["# TYPE x gauge\nx 1\n", None, "# TYPE x gauge\nx 2\n"])
    assert merged == '# TYPE x gauge\nx{replica="0"} 1\nx{replica="2"} 2\n'


def test_round_robin_alternates_and_bad_policy_is_one_line() -> None:
    router = Router([("127.0.0.1", 1), ("127.0.0.1", 2)], policy="round-robin")
    assert {router.choose("same") for _ in range(4)} == {0, 1}
    with pytest.raises(ValueError, match="not one of prefix, least-loaded, round-robin"):
        Router([("127.0.0.1", 1)], policy="random")


def test_all_dead_answers_503() -> None:
    router = Router([("127.0.0.1", free_port())])
    port = free_port()
    server = serve_in_thread(build_router_app(router, health_interval=0.1), port)
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x"})
        assert info.value.code == 503
    finally:
        server.should_exit = True


def test_real_replica_streaming_and_not(server) -> None:
    """In front of the shared real serve.py (and a dead port): the same greedy tokens as the
    replica gives directly, streamed or not."""
    router = Router([server.host_port, ("127.0.0.1", free_port())], prefix_tokens=4)
    port = free_port()
    app_server = serve_in_thread(build_router_app(router, health_interval=0.2), port)
    try:
        body = {"model": "jaxcb-tiny-random-llama-v1", "prompt": "Hello there", "max_tokens": 8,
                "temperature": 0.0}  # fmt: skip
        _, direct = post(server.url + "/v1/completions", body)
        expected = json.loads(direct)["choices"][0]["text"]
        for _ in range(3):  # the dead replica is never the answer
            headers, data = post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert headers["x-jaxcb-replica"] == "0"
            assert json.loads(data)["choices"][0]["text"] == expected
        _, data = post(f"http://127.0.0.1:{port}/v1/completions", {**body, "stream": True})
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        assert text == expected
    finally:
        app_server.should_exit = True
