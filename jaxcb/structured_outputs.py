"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or a grammar (vLLM's `StructuredOutputsParams`). Validated for shape when created;
whether the schema, regex or grammar itself is good is the grammar compiler's call
(engine/grammar.py), made before the request is queued."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The constraint kinds, one of which a StructuredOutputsParams sets.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `json_object`
    (True: any JSON object), `regex` (Rust regex syntax, matched in full), `choice` (one of
    these strings, exactly), `grammar` (Lark, or GBNF / EBNF as llama.cpp writes it).
    `disable_any_whitespace`: JSON without free whitespace between its tokens (compact)."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {list(KINDS)}, got {given or 'none'}"
            )
        (kind,) = given
        value = getattr(self, kind)
        checks = {
            "json": lambda v: isinstance(v, dict | str),
            "json_object": lambda v: v is True,
            "regex": lambda v: isinstance(v, str) and v != "",
            "choice": lambda v: bool(v) and all(isinstance(c, str) and c for c in v),
            "grammar": lambda v: isinstance(v, str) and v.strip() != "",
        }
        ok = checks[kind](value)
        if not ok:
            rule = {
                "json": "must be a JSON schema (an object or its JSON text)",
                "json_object": "must be true",
                "regex": "must be a non-empty string",
                "choice": "must be a non-empty list of non-empty strings",
                "grammar": "must be a non-empty grammar text",
            }[kind]
            raise ValueError(f"structured_outputs.{kind} {rule}, got {value!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a boolean, got "
                f"{self.disable_any_whitespace!r}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable key of the constraint (the grammar cache's)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | tuple):
            value = json.dumps(value, sort_keys=True)
        return self.kind, str(value), self.disable_any_whitespace

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """From a StructuredOutputsParams or a dict of its fields (unknown keys rejected)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {value!r}")
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown fields {unknown}; expected some of "
                f"{sorted(fields)}"
            )
        return cls(**value)
