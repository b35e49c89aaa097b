"""One OpenAI-compatible endpoint in front of N jaxcb servers, routing by prompt prefix.

    client ──> router (this app) ──> replica 0  (scripts/serve.py --port P0)
                                └──> replica 1  (scripts/serve.py --port P1) ...

Why prefix affinity: each replica has its own prefix cache. Sending prompts that start alike
to the replica that served that start recently lets its cached KV pages be reused; spraying
them (round-robin) makes every replica compute and cache every prefix.

Routing (`policy`):
- "prefix": the request's prefix key (below) maps, through a bounded LRU table, to the
  replica that last served it; an unknown key, an unhealthy replica, or one with more than
  `max_imbalance` requests in flight above the least-loaded goes to the least-loaded
  replica instead, which then owns the key.
- "least-loaded": fewest requests in flight (then fewest routed so far).
- "round-robin": in turn, for comparison.

The prefix key, computed without a tokenizer: for a token-id prompt its first
`prefix_tokens` ids; for a text prompt its first 4 x `prefix_tokens` characters (about as
many tokens); for chat, the same prefix of the messages serialized in order (the chat
template keeps their order, so equal leading messages give equal templated prefixes).

Streaming passes through: the replica's response body is forwarded chunk by chunk as it
arrives (SSE events unchanged), over pooled keep-alive connections (an httpx2 client). A
replica that cannot be reached, or drops the connection before it answers, is marked
unhealthy and the request goes to another. A health loop polls each replica's
/health; failed ones leave the rotation until they answer again, and `on_unhealthy` (the
launcher's restart, scripts/serve_replicas.py) is called for them.

GET /metrics concatenates the replicas' Prometheus metrics, each sample labelled with
`replica="i"`, grouped under one HELP/TYPE per family (sum over `replica` in PromQL for
totals), plus the router's own `jaxcb_router_*` counters. GET /router/stats: routing counts
and health as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

POLICIES = ("prefix", "least-loaded", "round-robin")
HOP_HEADERS = frozenset({"connection", "transfer-encoding", "content-length", "keep-alive", "host"})
CONNECT_TIMEOUT = 5.0  # seconds to reach a replica before it counts as failed


@dataclass
class Replica:
    """A replica's address and what the router knows of it."""

    host: str
    port: int
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0
    failures: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def prefix_key(body: dict[str, Any], prefix_tokens: int) -> str | None:
    """The routing key of a request body (module docstring); None when it has no prompt."""
    if "messages" in body:
        text: Any = json.dumps(body["messages"], ensure_ascii=False, sort_keys=True)
    else:
        text = body.get("prompt")
        if isinstance(text, list) and text and not isinstance(text[0], int):
            text = text[0]  # a batch of prompts: the first one's
    if isinstance(text, list):
        data = json.dumps(text[:prefix_tokens]).encode()
    elif isinstance(text, str):
        data = text[: 4 * prefix_tokens].encode()
    else:
        return None
    return hashlib.blake2b(data, digest_size=12).hexdigest()


class Router:
    """The routing state: replicas, their load, the prefix table. Async code calls it from
    one event loop, so it needs no locks."""

    def __init__(
        self,
        replicas: Sequence[tuple[str, int]],
        *,
        policy: str = "prefix",
        prefix_tokens: int = 256,
        table_size: int = 65536,
        max_imbalance: int = 8,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
        if not replicas:
            raise ValueError("the router needs at least one replica")
        if prefix_tokens < 1 or table_size < 1 or max_imbalance < 0:
            raise ValueError("prefix_tokens and table_size must be >= 1, max_imbalance >= 0")
        self.replicas = [Replica(host, port) for host, port in replicas]
        self.policy, self.prefix_tokens = policy, prefix_tokens
        self.table_size, self.max_imbalance = table_size, max_imbalance
        self.table: OrderedDict[str, int] = OrderedDict()  # prefix key -> replica index
        self.affinity_hits = 0  # requests sent where their prefix went before
        self._turn = 0

    def _least_loaded(self, candidates: list[int]) -> int:
        return min(
            candidates, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].routed, i)
        )

    def choose(self, key: str | None, exclude: frozenset[int] = frozenset()) -> int:
        """The replica for a request with prefix `key` (ValueError: none is healthy)."""
        healthy = [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]
        if not healthy:
            raise ValueError("no healthy replica")
        if self.policy == "round-robin":
            self._turn += 1
            return healthy[self._turn % len(healthy)]
        best = self._least_loaded(healthy)
        if self.policy == "least-loaded" or key is None:
            return best
        owner = self.table.get(key)
        floor = self.replicas[best].in_flight
        if (
            owner in healthy
            and owner is not None
            and self.replicas[owner].in_flight <= floor + self.max_imbalance
        ):
            self.table.move_to_end(key)
            self.affinity_hits += 1
            return owner
        self.table[key] = best
        self.table.move_to_end(key)
        while len(self.table) > self.table_size:
            self.table.popitem(last=False)
        return best

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "affinity_hits": self.affinity_hits,
            "table_size": len(self.table),
            "replicas": [vars(r).copy() for r in self.replicas],
        }


def replica_client() -> httpx.AsyncClient:
    """The router's HTTP client: pooled keep-alive connections to the replicas; a connect
    timeout, none on reading (a long generation streams for as long as it takes)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT, read=None, write=None, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )


async def fetch(
    client: httpx.AsyncClient, replica: Replica, path: str, timeout: float = 5.0
) -> tuple[int, bytes]:
    """GET `path` from a replica: (status, body)."""
    answer = await client.get(replica.url + path, timeout=timeout)
    return answer.status_code, answer.content


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def merge_metrics(texts: Sequence[str | None]) -> str:
    """Prometheus text of several replicas as one: `replica="i"` on every sample, the
    samples of a family together under its first HELP/TYPE lines."""
    families: OrderedDict[str, tuple[list[str], list[str]]] = OrderedDict()
    for index, text in enumerate(texts):
        if text is None:
            continue
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                head, _ = families.setdefault(family, ([], []))
                if line not in head:
                    head.append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, rest = match.groups()
            inner = labels[1:-1] if labels else ""
            label = f'replica="{index}"' + ("," + inner if inner else "")
            families.setdefault(family or name, ([], []))[1].append(f"{name}{{{label}}}{rest}")
    return "".join("\n".join(head + samples) + "\n" for head, samples in families.values())


def build_router_app(
    router: Router,
    *,
    health_interval: float = 2.0,
    on_unhealthy: Callable[[int], None] | None = None,
) -> FastAPI:
    """The router's FastAPI app (module docstring); the health loop runs with its lifespan."""

    async def check(client: httpx.AsyncClient, index: int) -> None:
        replica = router.replicas[index]
        try:
            status, _ = await fetch(client, replica, "/health", max(1.0, health_interval))
            ok = status == 200
        except (httpx.HTTPError, OSError):
            ok = False
        if replica.healthy != ok:
            logger.warning("replica %d (port %d) is %s", index, replica.port,
                           "back" if ok else "unhealthy: out of rotation")  # fmt: skip
        replica.healthy = ok
        if not ok:
            replica.failures += 1
            if on_unhealthy is not None:  # (a restart may block: off the event loop)
                await asyncio.to_thread(on_unhealthy, index)

    async def health_loop(client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(check(client, i) for i in range(len(router.replicas))))
            await asyncio.sleep(health_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with replica_client() as client:
            app.state.client = client
            task = asyncio.create_task(health_loop(client))
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(title="jaxcb router", lifespan=lifespan)
    app.state.router = router

    async def forward(request: Request, key: str | None, body: bytes) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        headers = {k: v for k, v in request.headers.items() if k not in HOP_HEADERS}
        tried: set[int] = set()
        while True:
            try:
                index = router.choose(key, frozenset(tried))
            except ValueError as exc:
                return JSONResponse(_error(str(exc), 503), status_code=503)
            replica = router.replicas[index]
            replica.in_flight += 1
            outgoing = client.build_request(
                request.method, replica.url + request.url.path, content=body, headers=headers
            )
            try:
                answer = await client.send(outgoing, stream=True)
            except httpx.TransportError as exc:  # unreachable, or dropped before answering
                replica.in_flight -= 1
                replica.healthy, replica.failures = False, replica.failures + 1
                logger.warning("replica %d failed (%r): out of rotation", index, exc)
                if on_unhealthy is not None:
                    on_unhealthy(index)
                tried.add(index)
                continue
            replica.routed += 1
            break

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():  # the bytes as sent: SSE unchanged
                    yield chunk
            finally:
                replica.in_flight -= 1
                await answer.aclose()

        kept = {k: v for k, v in answer.headers.items() if k not in HOP_HEADERS}
        kept["x-jaxcb-replica"] = str(index)
        return StreamingResponse(stream(), status_code=answer.status_code, headers=kept)

    async def routed(request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            parsed = None  # the replica answers with its own error
        key = prefix_key(parsed, router.prefix_tokens) if isinstance(parsed, dict) else None
        return await forward(request, key, body)

    app.add_api_route("/v1/completions", routed, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routed, methods=["POST"])
    app.add_api_route("/v1/models", routed, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        if any(r.healthy for r in router.replicas):
            return Response(status_code=200)
        return JSONResponse(_error("no healthy replica", 503), status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client

        async def text(replica: Replica) -> str | None:
            try:
                status, data = await fetch(client, replica, "/metrics")
            except (httpx.HTTPError, OSError):
                return None
            return data.decode() if status == 200 else None

        texts = await asyncio.gather(*(text(r) for r in router.replicas))
        return Response(merge_metrics(texts) + _own_metrics(router), media_type="text/plain")

    @app.get("/router/stats")
    async def stats() -> Response:
        return JSONResponse(router.stats())

    return app


def _own_metrics(router: Router) -> str:
    lines = [
        "# HELP jaxcb_router_routed_total Requests sent to each replica.",
        "# TYPE jaxcb_router_routed_total counter",
        *(
            f'jaxcb_router_routed_total{{replica="{i}"}} {r.routed}'
            for i, r in enumerate(router.replicas)
        ),
        "# HELP jaxcb_router_healthy Whether each replica is in rotation.",
        "# TYPE jaxcb_router_healthy gauge",
        *(
            f'jaxcb_router_healthy{{replica="{i}"}} {int(r.healthy)}'
            for i, r in enumerate(router.replicas)
        ),
        "# HELP jaxcb_router_affinity_hits_total Requests sent where their prefix went before.",
        "# TYPE jaxcb_router_affinity_hits_total counter",
        f"jaxcb_router_affinity_hits_total {router.affinity_hits}",
    ]
    return "\n".join(lines) + "\n"


def _error(message: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "service_unavailable", "code": code}}
