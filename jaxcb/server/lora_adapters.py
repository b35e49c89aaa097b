"""The server's LoRA adapters, as vLLM serves them: `--lora-modules name=path` at start-up,
a request's `model` field naming one, `/v1/models` listing them beside the base model, and,
with `--allow-runtime-lora-updating`, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (behind the API key like every /v1 route).

An adapter loaded at run time is read and checked on a worker thread while the engine
steps on (a bad one is a 400 that leaves the server serving), then added to the engine on
its own thread between two steps (`EngineLoop.call`). The device slots are the engine's
business (engine/lora_slots.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxcb.engine.interface import Engine
from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.server.engine_loop import EngineLoop
from jaxcb.server.protocol import (
    APIError,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
    parse_body,
)
from jaxcb.server.request_body import read_json_body

#: the most a load / unload body may be (a name and a path)
MAX_BODY_BYTES = 64 * 1024


def parse_lora_modules(values: Sequence[str]) -> list[tuple[str, str]]:
    """`--lora-modules` values, each NAME=PATH, as (name, path); ValueError naming a bad one."""
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes NAME=PATH values, got {value!r}")
        modules.append((name.strip(), path.strip()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must differ, got {names}")
    return modules


class ServedLoras:
    """The adapters a request's `model` may name, by name (shared with OpenAIServing)."""

    def __init__(self, engine: Engine, by_name: dict[str, LoRARequest], base_names: Sequence[str]):
        self.engine = engine
        self.by_name = by_name
        self.base_names = tuple(base_names)
        self._next_id = 1

    def check_name(self, name: str) -> None:
        if name in self.base_names:
            raise ValueError(f"LoRA name {name!r} is the base model's served name")
        if name in self.by_name:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")

    def read(self, name: str, path: str) -> object:
        """The adapter's weights read and checked (any thread: `Engine.read_lora`)."""
        return self.engine.read_lora(LoRARequest(name, self._next_id, path))

    def register(self, name: str, path: str, values: object = None) -> LoRARequest:
        """Add an adapter to the engine (on the engine's thread, or before it runs);
        `values` from `read`, else it is read here."""
        self.check_name(name)
        lora = LoRARequest(name, self._next_id, path)
        self.engine.add_lora(lora, values)
        self._next_id += 1
        self.by_name[name] = lora
        return lora

    def unregister(self, name: str) -> LoRARequest:
        lora = self.by_name[name]
        self.engine.remove_lora(lora.lora_int_id)
        del self.by_name[name]
        return lora

    def model_cards(self, created: int, show_path: bool, max_model_len: int) -> list[dict]:
        """/v1/models' entries of the adapters."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jaxcb",
                "root": lora.lora_path if show_path else name,
                "parent": self.base_names[0],
                "max_model_len": max_model_len,
            }
            for name, lora in self.by_name.items()
        ]


def install_lora_routes(v1: APIRouter, loras: ServedLoras, engine_loop: EngineLoop) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating)."""

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        raw = await read_json_body(request, MAX_BODY_BYTES)
        body = parse_body(raw, LoadLoRAAdapterRequest)
        try:
            loras.check_name(body.lora_name)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        try:  # read off the engine's thread: the steps go on meanwhile
            values = await asyncio.to_thread(loras.read, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None

        def load() -> LoRARequest:
            try:
                return loras.register(body.lora_name, body.lora_path, values)
            except ValueError as exc:
                raise bad_request(str(exc), "lora_name") from None

        await engine_loop.call(load)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        raw = await read_json_body(request, MAX_BODY_BYTES)
        body = parse_body(raw, UnloadLoRAAdapterRequest)

        def unload() -> LoRARequest:
            if body.lora_name not in loras.by_name:
                raise APIError(
                    404,
                    f"the LoRA adapter {body.lora_name!r} is not loaded",
                    param="lora_name",
                    code="model_not_found",
                )
            try:
                return loras.unregister(body.lora_name)
            except ValueError as exc:  # requests still use it
                raise APIError(409, str(exc), param="lora_name") from None

        await engine_loop.call(unload)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
