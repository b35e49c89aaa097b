"""Tool calling in chat completions: the request's `tools` and `tool_choice`, the constraint
that `required` and a named function put on the output, and the parsers that find tool calls
in what the model wrote (`--tool-call-parser`).

- `none`: the tools are rendered (the template decides how) and the output is plain content.
- `auto` (the default with tools): the output is free; the parser finds the calls the model
  made in its own format (`--tool-call-parser`: Hermes' `<tool_call>` blocks, or Llama 3's
  JSON; server/tool_parsers.py) and the rest is content.
- `required`: the output is a JSON array of at least one `{"name", "parameters"}` object, each
  name one of the tools and its parameters valid under that tool's schema (vLLM's form).
- a named function: the output is that function's arguments, valid under its schema.

A response with calls carries them as `tool_calls` (ids, names, JSON `arguments`) with
`finish_reason: "tool_calls"` (or "length" when max_tokens cut the arguments off); a stream
sends each call's id and name once known and its arguments as deltas while they are
generated. `parallel_tool_calls: false` keeps one call (`required`: an array of one).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from jaxcb.server.tool_parsers import PARSERS, CallText, json_array_calls


class ToolError(ValueError):
    """A bad `tools` / `tool_choice`: the message and the field (a 400, protocol.py)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema ({"type": "object"} when none was given)

    def template_dict(self) -> dict[str, Any]:
        """As chat templates take a tool (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def parse_tools(tools: list[Any]) -> list[Tool]:
    """The request's `tools` as Tools; a malformed one is a ToolError naming `tools`."""
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict) and tool.get("type", "function") == "function"
        ) or not isinstance(function, dict):
            shape = "{'type': 'function', 'function': {...}}"
            raise ToolError(f"tools[{i}] must be {shape}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}",
                "tools",
            )
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        description = function.get("description")
        out.append(Tool(name, description if isinstance(description, str) else None, parameters))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ToolError(f"tools name the same function twice: {names}", "tools")
    return out


def template_call(call: Any) -> dict[str, Any]:
    """A call sent back in an assistant message, as chat templates take it: its arguments
    as an object (they arrive as JSON text, as OpenAI sends them)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        shape = "{'function': {'name', 'arguments'}}"
        raise ToolError(f"tool_calls entries must be {shape}", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else left as the text it is
            arguments = json.loads(arguments)
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def resolve_choice(tool_choice: Any, tools: list[Tool]) -> str | Tool:
    """ "none", "auto", "required", or the Tool a named choice forces."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            "tool_choice must be none, auto, required or {'type': 'function', "
            "'function': {'name': ...}}",
            "tool_choice",
        )
    for tool in tools:
        if tool.name == name:
            return tool
    raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")


def tool_constraint(
    choice: str | Tool, tools: list[Tool], parallel: bool = True
) -> dict[str, Any] | None:
    """The structured-outputs constraint a choice puts on the output (None: free); not
    `parallel`: `required` asks for exactly one call."""
    if isinstance(choice, Tool):
        return {"json": choice.parameters}
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return {"json": array}


@dataclass
class ToolMode:
    """One chat request's tool handling: how to read the output, whole or growing, into
    content and calls (server/tool_parsers.py: each call's arguments are the model's own
    text of them, so a stream's argument deltas join to the whole output's arguments)."""

    choice: str | Tool
    tools: list[Tool]
    parser: str = "hermes"
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @property
    def constrained(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, Tool)

    def call_texts(self, text: str) -> list[CallText]:
        """The calls in `text` (a prefix of the output or all of it), as far as it goes."""
        if self.choice == "none":
            return []
        if isinstance(self.choice, Tool):  # the output is the arguments
            calls = [CallText(self.choice.name, text)]
        elif self.choice == "required":
            calls = json_array_calls(text)
        else:
            calls = PARSERS[self.parser].parse(text).calls
        return calls if self.parallel else calls[:1]

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. A constrained output cut off by max_tokens
        still gives its calls, with the arguments it got; `required` cut off before its first
        call's name gives the text as content."""
        calls = [ToolCall(c.name, c.arguments or "") for c in self.call_texts(text)]
        if self.choice == "none" or (self.constrained and not calls):
            return text, []
        if self.constrained:
            return None, calls
        return PARSERS[self.parser].parse(text).content, calls

    def streamable_content(self, text: str) -> str:
        """The part of a growing output that is surely content: none of a constrained one;
        under `auto`, what the parser cannot take for (the start of) a call."""
        if self.constrained:
            return ""
        if self.choice == "none":
            return text
        return PARSERS[self.parser].content_prefix(text)
