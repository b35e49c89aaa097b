"""Reading tool calls out of a model's text (server/tool_parsers.py, server/tools.py): the
formats, and the property a stream rests on: every prefix of an output gives calls whose
names are the whole output's and whose arguments are prefixes of its arguments, and
content that is a prefix of its content."""

from __future__ import annotations

import json

import pytest

from jaxcb.server.tool_parsers import CallText, hermes, json_array_calls, llama3_json
from jaxcb.server.tools import Tool, ToolMode, tool_constraint

WEATHER = Tool("get_weather", None, {"type": "object"})
TIME = Tool("get_time", None, {"type": "object"})
TOOLS = [WEATHER, TIME]

HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } in a string"}}\n'
    '</tool_call>\n<tool_call>{"arguments": {"timezone": "CET"}, "name": "get_time"}'
    "</tool_call>"
)
LLAMA3_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
    '{"name": "get_time", "parameters": {"timezone": "CET"}}'
)
REQUIRED_TWO = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {"timezone": "CET"}}]'
)


def test_hermes_reads_calls_and_keeps_the_rest_as_content():
    parsed = hermes(HERMES_TWO)
    assert parsed.content == "Let me check.\n\n"
    assert parsed.calls == [
        CallText("get_weather", '{"city": "Paris", "note": "a } in a string"}'),
        CallText("get_time", '{"timezone": "CET"}'),
    ]
    # a block that is no call stays content; a call without arguments has {}
    parsed = hermes('a <tool_call>not json</tool_call> b <tool_call>{"name": "f"}</tool_call>')
    assert parsed.content == "a <tool_call>not json</tool_call> b "
    assert parsed.calls == [CallText("f", "{}")]
    assert hermes("no calls").calls == [] and hermes("no calls").content == "no calls"


def test_llama3_json_reads_calls_at_the_start_only():
    parsed = llama3_json(LLAMA3_TWO)
    assert parsed.content is None
    assert parsed.calls == [
        CallText("get_weather", '{"city": "Paris", "days": 3}'),
        CallText("get_time", '{"timezone": "CET"}'),
    ]
    text = 'The call would be {"name": "get_time", "parameters": {}}'
    assert llama3_json(text).calls == [] and llama3_json(text).content == text


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        (ToolMode("auto", TOOLS, "hermes"), HERMES_TWO),
        (ToolMode("auto", TOOLS, "llama3_json"), LLAMA3_TWO),
        (ToolMode("required", TOOLS), REQUIRED_TWO),
        (ToolMode(WEATHER, TOOLS), '{"city": "Paris", "unit": "celsius"}'),
    ],
    ids=["hermes", "llama3_json", "required", "named"],
)
def test_every_prefix_gives_a_prefix_of_the_whole_outputs_calls_and_content(mode, text):
    content, calls = mode.calls(text)
    assert calls and all(json.loads(c.arguments) is not None for c in calls)
    for end in range(len(text) + 1):
        prefix = text[:end]
        streamed = mode.streamable_content(prefix)
        assert (content or "").startswith(streamed), (end, streamed)
        grown = mode.call_texts(prefix)
        assert len(grown) <= len(calls), end
        for got, whole in zip(grown, calls, strict=False):
            assert got.name == whole.name, end
            assert whole.arguments.startswith(got.arguments or ""), (end, got.arguments)
    # the arguments grow while they are generated, not at the end only
    middle = mode.call_texts(text[: len(text) * 3 // 4])
    assert middle and middle[0].arguments


def test_cut_off_outputs_still_give_their_calls():
    content, calls = ToolMode(WEATHER, TOOLS).calls('{"city": "Pa')
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Pa')
    ]
    content, calls = ToolMode("required", TOOLS).calls('[{"name": "get_time", "parameters": {"ti')
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"ti')]
    # cut off before the first name: the text, as content
    assert ToolMode("required", TOOLS).calls('[{"na') == ('[{"na', [])
    assert [c.name for c in json_array_calls('[{"name": "get_time"')] == ["get_time"]


def test_parallel_tool_calls_false_keeps_one_call():
    assert len(ToolMode("auto", TOOLS, "hermes", parallel=False).calls(HERMES_TWO)[1]) == 1
    assert len(ToolMode("required", TOOLS, parallel=False).calls(REQUIRED_TWO)[1]) == 1
    assert tool_constraint("required", TOOLS, parallel=False)["json"]["maxItems"] == 1
    assert "maxItems" not in tool_constraint("required", TOOLS)["json"]
