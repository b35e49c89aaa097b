"""Structured outputs through the server with the official openai client: response_format
(json_schema, json_object), vLLM's structured_outputs and guided_* fields in extra_body,
streaming equal to non-streaming, and bad constraints as 400s in OpenAI's error shape."""

from __future__ import annotations

import json
import re

import pytest

from jaxcb.models.loading.default_model import NAME as MODEL

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}
CODE = "[0-9]{3}-[a-z]{2}"
SO = "structured_outputs"
CHAT = [{"role": "user", "content": "Pick a color."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


def chat_text(client, stream: bool, **kw) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=128, temperature=0, stream=stream, **kw
    )
    if not stream:
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = "", None
    for chunk in out:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_response_format_json_schema_stream_and_not(openai_client):
    text, finish = chat_text(openai_client, False, response_format=FORMAT)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"
    assert chat_text(openai_client, True, response_format=FORMAT) == (text, finish)
    # any object: the random model writes one key until max_tokens, so only its start and
    # the finish reason are checked here (the real model's suite is tests/e2e)
    text, finish = chat_text(openai_client, False, response_format={"type": "json_object"})
    assert text.lstrip().startswith("{") and finish in ("stop", "length")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        (
            {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
            lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t),
        ),
        ({"guided_grammar": 'start: "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
    ],
)
def test_completions_with_vllm_fields(openai_client, extra, check):
    out = openai_client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=32, temperature=0, extra_body=extra
    )
    assert check(out.choices[0].text) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {"extra_body": {"guided_json": {"type": "object", "properties": 5}}},
            "structured_outputs",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": FORMAT, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_400s(openai_client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, **kw)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert "\n" not in body["message"]
    ok = openai_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # the server keeps serving
