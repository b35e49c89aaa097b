"""The structured-output suite: JSON schemas (nested objects, arrays with min/max items, enums,
numbers with ranges, required and optional fields, string patterns), regexes and choices, each
with a chat prompt, and the check that an output satisfies its constraint.

Strings carry a maxLength and arrays a maxItems, so every constrained output ends well within
`MAX_TOKENS` (a small model may otherwise write one string until the token limit, which no
grammar can stop). Regexes use the syntax Rust's `regex` and Python's `re` share.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 192
NAME = {"type": "string", "minLength": 1, "maxLength": 24}
TEXT = {"type": "string", "maxLength": 48}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object schema without extra properties, all properties required unless listed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a fictional person.", obj({"name": NAME, "age": {"type": "integer"}})),
    "age_range": (
        "Invent a customer record.",
        obj({"name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    ),
    "temperature": (
        "Report today's weather.",
        obj({"city": NAME, "celsius": {"type": "number", "minimum": -40, "maximum": 50}}),
    ),
    "enum_color": (
        "Pick a color for a logo.",
        obj({"color": {"enum": ["red", "green", "blue", "black"]}}),
    ),
    "enum_int": ("Rate this movie from 1 to 5.", obj({"stars": {"enum": [1, 2, 3, 4, 5]}})),
    "boolean": (
        "Is Paris the capital of France?",
        obj({"answer": {"type": "boolean"}, "reason": TEXT}),
    ),
    "optional_fields": (
        "Describe a book.",
        obj({"title": NAME, "author": NAME, "year": {"type": "integer"}}, required=["title"]),
    ),
    "nested": (
        "Describe a company and its address.",
        obj({"company": NAME, "address": obj({"street": NAME, "city": NAME, "zip": NAME})}),
    ),
    "deep_nested": (
        "Describe a small team.",
        obj(
            {"team": obj({"lead": obj({"name": NAME, "email": NAME})}), "size": {"type": "integer"}}
        ),
    ),
    "array_minmax": (
        "List some fruits.",
        obj({"fruits": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}}),
    ),
    "array_of_objects": (
        "List two planets and their order from the Sun.",
        obj(
            {
                "planets": {
                    "type": "array",
                    "items": obj({"name": NAME, "order": {"type": "integer", "minimum": 1}}),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    "integer_array": (
        "Give me a few prime numbers.",
        obj({"primes": {"type": "array", "items": {"type": "integer"}, "maxItems": 5}}),
    ),
    "pattern_date": (
        "When was the first moon landing?",
        obj({"event": NAME, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    ),
    "pattern_code": (
        "Make up a product code.",
        obj(
            {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "price": {"type": "number"},
            }
        ),
    ),
    "const": (
        "Acknowledge the order.",
        obj({"status": {"const": "ok"}, "order_id": {"type": "integer"}}),
    ),
    "any_of": (
        "Give an ID, as a number or a name.",
        obj({"id": {"anyOf": [{"type": "integer"}, NAME]}}),
    ),
    "nullable": (
        "Who is the current king of France?",
        obj({"king": {"anyOf": [NAME, {"type": "null"}]}}),
    ),
    "unique_tags": (
        "Tag this article about cooking.",
        obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["food", "recipe", "home", "health"]},
                    "maxItems": 3,
                }
            }
        ),
    ),
    "multi_type": (
        "Describe a laptop for sale.",
        obj(
            {
                "model": NAME,
                "price": {"type": "number", "minimum": 0},
                "in_stock": {"type": "boolean"},
                "ports": {"type": "array", "items": NAME, "maxItems": 3},
            }
        ),
    ),
    "ref_defs": (
        "Describe two points on a plane.",
        {
            "$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
            **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
        },
    ),
    "string_enum_list": (
        "Which days are weekend days?",
        obj(
            {
                "days": {
                    "type": "array",
                    "items": {"enum": ["saturday", "sunday", "monday"]},
                    "minItems": 1,
                    "maxItems": 2,
                }
            }
        ),
    ),
    "score": (
        "Grade this essay.",
        obj(
            {
                "grade": {"enum": ["A", "B", "C", "D", "F"]},
                "score": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
    ),
}

REGEXES: dict[str, tuple[str, str]] = {
    "phone": ("What is a phone number format in the US?", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    "ip": (
        "Give me an IP address.",
        r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    ),
    "yes_no_reason": (
        "Is water wet? Answer yes or no, then why.",
        r"(Yes|No), because [a-z ]{1,40}\.",
    ),
    "email": ("What is an example email address?", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"),
    "time": ("What time is lunch?", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
}

CHOICES: dict[str, tuple[str, list[str]]] = {
    "sentiment": ("'I loved this film!' Is that positive or negative?", ["positive", "negative"]),
    "capital": ("What is the capital of Italy?", ["Rome", "Milan", "Naples", "Turin"]),
    "planet": ("Which planet is the largest?", ["Mercury", "Venus", "Earth", "Mars", "Jupiter"]),
}


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    structured_outputs: dict[str, Any]  # SamplingParams.structured_outputs

    def check(self, text: str) -> str | None:
        """None if `text` satisfies the constraint, else what is wrong."""
        so = self.structured_outputs
        if "json" in so:
            import jsonschema

            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                return f"not JSON: {exc}"
            try:
                jsonschema.validate(value, so["json"])
            except jsonschema.ValidationError as exc:
                return f"does not validate: {exc.message}"
            return None
        if "regex" in so:
            return None if re.fullmatch(so["regex"], text) else "does not match the regex"
        return None if text in so["choice"] else f"not one of {so['choice']}"


def cases() -> list[Case]:
    """Every case of the suite: schemas, then regexes, then choices."""
    out = [Case(f"json:{k}", p, {"json": s}) for k, (p, s) in SCHEMAS.items()]
    out += [Case(f"regex:{k}", p, {"regex": r}) for k, (p, r) in REGEXES.items()]
    out += [Case(f"choice:{k}", p, {"choice": c}) for k, (p, c) in CHOICES.items()]
    return out


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]
