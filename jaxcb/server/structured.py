"""A request's structured-output fields, in any of the names clients send, as one
StructuredOutputsParams: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (all in the body, where the openai client's `extra_body`
puts them). Two of them at once is a 400."""

from __future__ import annotations

from typing import Any

from jaxcb.structured_outputs import StructuredOutputsParams


class StructuredOutputsError(ValueError):
    """A bad constraint field: the message and the request field it names (protocol.py
    answers it as a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str) -> StructuredOutputsError:
    return StructuredOutputsError(message, param)


#: vLLM's older request fields -> StructuredOutputsParams fields.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The body's constraint (None: free text); a bad or doubled one is a 400 naming it."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        found.append(("structured_outputs", dict(body.structured_outputs)))
    for name, field in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, {field: value}))
    if body.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported (structured_outputs."
            "disable_any_whitespace gives compact JSON)",
            "guided_whitespace_pattern",
        )
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one structured output constraint, got {names}", found[1][0])
    name, spec = found[0]
    try:
        return StructuredOutputsParams.of(spec)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), name) from None


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request(
                "response_format json_schema must be {'name', 'schema': {...}, 'strict'}",
                "response_format",
            )
        return {"json": spec.get("schema", {})}
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        "response_format",
    )
