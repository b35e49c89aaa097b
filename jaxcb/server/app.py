"""The FastAPI app: routes, API-key check, and OpenAI-shaped errors for every failure.

    POST /v1/completions       POST /v1/chat/completions     GET /v1/models
    GET  /health               GET  /metrics

The app owns no engine state: `build_app` takes a ready engine (`Engine`), wraps it in an
`EngineLoop` (started and stopped with the app's lifespan) and serves from it.

Handlers parse their bodies themselves (strict, with field-naming errors), so /openapi.json
gets the request body schemas from the pydantic models explicitly: clients and API fuzzers
see exactly what the server validates.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from jaxcb.engine.interface import Engine
from jaxcb.engine.step_trace import save_trace, trace_meta
from jaxcb.server.engine_loop import EngineLoop
from jaxcb.server.lora_adapters import ServedLoras, install_lora_routes
from jaxcb.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxcb.server.prompts import PromptEncoder
from jaxcb.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from jaxcb.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    shutdown_timeout: float = 10.0  # seconds running requests get to finish on shutdown
    max_request_body_bytes: int = 8 * 2**20  # larger bodies get 413 (a few MB: see cli.py)
    show_model_path: bool = False  # /v1/models' "root": the model's path, not the served name
    step_trace: Path | None = None  # every step's record, written here on shutdown (JSON)
    chat_template: str | None = None  # a Jinja chat template instead of the tokenizer's
    tool_call_parser: str = "hermes"  # how `auto` tool choice reads calls (server/tools.py)
    # LoRA adapters served at start-up, (name, PEFT dir); whether /v1/load_lora_adapter and
    # /v1/unload_lora_adapter exist (--allow-runtime-lora-updating)
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        # HTTP header values are bytes that servers (Starlette too) decode as Latin-1 and
        # clients encode as they like: only printable ASCII means the same bytes to both.
        key = self.api_key
        if key is not None and not (key.isascii() and key.isprintable() and key.strip()):
            bad = next((c for c in key if not (c.isascii() and c.isprintable())), None)
            raise ValueError(
                "--api-key must be printable ASCII (it travels in an HTTP header)"
                + (f": it has {bad!r} at position {key.index(bad)}" if bad else ", not blank")
            )


def build_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    model_name = settings.served_model_names[0]
    metrics = ServerMetrics(model_name, engine.info.token_buckets)
    metrics.engine_info(engine.info)
    engine_loop = EngineLoop(engine, metrics)
    if settings.step_trace is not None:
        engine_loop.steps = []
    encoder = PromptEncoder(engine, chat_template=settings.chat_template)
    serving = OpenAIServing(
        engine_loop, encoder, list(settings.served_model_names), settings.max_request_body_bytes
    )
    serving.tool_call_parser = settings.tool_call_parser
    loras = ServedLoras(engine, serving.loras, settings.served_model_names)
    for name, path in settings.lora_modules:  # (before the engine thread starts)
        loras.register(name, path)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            encoder.close()
            await asyncio.to_thread(engine_loop.stop)
            if settings.step_trace is not None:
                _save_step_trace(settings.step_trace, engine_loop, engine)

    # No redirect from "/v1/completions/" to "/v1/completions": its Location would be built
    # from the client's Host header. A path with a trailing slash is a 404 like any other.
    app = FastAPI(
        title="jaxcb", lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False
    )
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.encoder = encoder

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(settings.api_key))])

    schemas: dict[str, dict] = {}

    @v1.post("/completions", openapi_extra=_request_body(CompletionRequest, schemas))
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @v1.post("/chat/completions", openapi_extra=_request_body(ChatCompletionRequest, schemas))
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    created = int(time.time())

    @v1.get("/models")
    async def models() -> dict:
        return _model_list(engine, settings, loras, created)

    if settings.allow_runtime_lora_updating:
        install_lora_routes(v1, loras, engine_loop)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            raise APIError(503, engine_loop.failure_reason, type="service_unavailable")
        if engine_loop.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _install_error_handlers(app)
    _install_openapi(app, schemas)
    return app


def _save_step_trace(path: Path, engine_loop: EngineLoop, engine: Engine) -> None:
    """serve.py --step-trace: the records of every step served, as a step trace."""
    steps = engine_loop.steps or []
    try:
        save_trace(path, steps, trace_meta(engine, served=True))
    except OSError as exc:
        logger.error("cannot write the step trace to %s: %s", path, exc)
        return
    logger.info("step trace of %d steps written to %s", len(steps), path)


def _model_list(engine: Engine, settings: ServerSettings, loras: ServedLoras, created: int) -> dict:
    """The body of GET /v1/models: the served names, then the LoRA adapters."""
    # Where the server keeps its files is none of its clients' business, unless asked.
    show_path = settings.show_model_path
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jaxcb",
                "root": engine.info.model_path if show_path else name,
                "max_model_len": engine.max_model_len,
            }
            for name in settings.served_model_names
        ]
        + loras.model_cards(created, show_path, engine.max_model_len),
    }


def _install_openapi(app: FastAPI, schemas: dict[str, dict]) -> None:
    """/openapi.json with the request body schemas of the routes that parse bodies."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _request_body(model: type[BaseModel], schemas: dict[str, dict]) -> dict:
    """The OpenAPI requestBody of a route that parses `model` itself; the model's nested
    schemas go into `schemas` (the document's components)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # The header as it came (Starlette decoded its bytes as Latin-1), against the key's
        # bytes (ASCII, checked in ServerSettings).
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode("latin-1"), api_key.encode("ascii")
        ):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, type="invalid_request_error"),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            error_body(f"invalid request: {exc.errors()}", type="invalid_request_error"),
            status_code=400,
        )

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # Anyone can do this (hang up while sending a body): one quiet line, no traceback.
        logger.debug("the client of %s %s went away", request.method, request.url.path)
        return Response(status_code=499)  # nobody is left to read it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal error: {exc}", type="server_error"), status_code=500
        )
