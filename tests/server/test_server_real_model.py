"""`scripts/serve.py` with no --model serves the real default, SmolLM2-135M-Instruct, and
answers a factual chat question through the official openai client, streaming and not; tool
calling (named, required, auto, tool results) on it."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

NAME = "SmolLM2-135M-Instruct"  # the default model's served name
# Sized for the test: two buckets to compile, room for the chat template's system prompt.
ARGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--token-buckets", "16", "64"]
ARGS += ["--max-model-len", "512"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(start_server):
    with (
        start_server(ARGS) as server,
        openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as c,
    ):
        yield c


def test_the_default_model_is_served(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_a_factual_question_is_answered(client):
    out = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=32, temperature=0
    )
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # ended by <|im_end|>, not the length cap


def test_a_factual_question_is_answered_streaming(client):
    stream = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=32, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "Paris" in "".join(pieces), pieces
    assert len([p for p in pieces if p]) > 1  # streamed, not one block


# ---- tool calling (SmolLM2's ChatML template ignores tools: jaxcb's renders them) ---------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ARGS_PARIS = '{"city": "Paris", "unit": "celsius"}'
# a regex that forces the output to be a Hermes call (auto's parser reads it)
HERMES_PARIS = r'<tool_call>\{"name": "get_weather", "arguments": '
HERMES_PARIS += r'\{"city": "Paris", "unit": "celsius"\}\}</tool_call>'


def _calls(client, stream: bool, **kw):
    """(content, [(name, arguments)], finish_reason) of one chat answer; a stream's deltas
    assembled as OpenAI clients assemble them."""
    kw.setdefault("max_tokens", 96)
    out = client.chat.completions.create(
        model=NAME, messages=kw.pop("messages", ASK), tools=TOOLS, temperature=0,
        stream=stream, **kw,
    )  # fmt: skip
    if not stream:
        m = out.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls or [])
        return m.content, calls, out.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in out:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                name += call.function.name or ""
                calls[call.index] = (name, args + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choices_give_valid_arguments(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        content, calls, finish = _calls(client, stream, tool_choice=choice)
        assert content is None and calls and finish == "tool_calls"
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        if choice is named:
            assert [name for name, _ in calls] == ["get_weather"]
    assert _calls(client, True, tool_choice=named)[1] == _calls(client, False, tool_choice=named)[1]


def test_auto_parses_a_call_and_returns_plain_content_otherwise(client):
    # The output is forced (a regex) to be a Hermes call, or plain text: auto's parser reads it.
    for stream in (False, True):
        content, calls, finish = _calls(
            client, stream, tool_choice="auto", extra_body={"guided_regex": HERMES_PARIS}
        )
        assert content is None and finish == "tool_calls"
        assert calls == [("get_weather", ARGS_PARIS)]
        content, calls, finish = _calls(
            client, stream, tool_choice="auto", extra_body={"guided_regex": "It is sunny[.]"}
        )
        assert (content, calls, finish) == ("It is sunny.", [], "stop")


@pytest.mark.parametrize(
    ("choice", "extra"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, {}),
        ("required", {}),
        ("auto", {"guided_regex": HERMES_PARIS}),
    ],
    ids=["named", "required", "auto"],
)
def test_streamed_tool_calls_send_their_arguments_while_they_are_generated(client, choice, extra):
    """The OpenAI SDK's own stream accumulation (`chat.completions.stream`, as its docs
    show) gives the non-streamed calls, and the arguments arrive in many deltas, not whole
    at the end."""
    with client.chat.completions.stream(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96,
        temperature=0, extra_body=extra,
    ) as stream:  # fmt: skip
        deltas = sum(1 for e in stream if e.type == "tool_calls.function.arguments.delta")
        final = stream.get_final_completion().choices[0]
    streamed = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert streamed == _calls(client, False, tool_choice=choice, extra_body=extra)[1]
    assert final.finish_reason == "tool_calls" and deltas > 3, deltas


def test_a_cut_off_named_call_is_still_a_call_and_one_call_when_parallel_is_off(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        content, calls, finish = _calls(client, stream, tool_choice=named, max_tokens=4)
        assert content is None and finish == "length"
        assert [name for name, _ in calls] == ["get_weather"] and calls[0][1].startswith("{")
    for stream in (False, True):
        calls = _calls(client, stream, tool_choice="required", parallel_tool_calls=False)[1]
        assert len(calls) == 1


def test_tool_results_go_back_as_tool_messages(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGS_PARIS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21, "sky": "clear"}'},
    ]
    content, calls, finish = _calls(client, False, messages=history, tool_choice="none")
    assert calls == [] and content and finish in ("stop", "length")


# ---- structured outputs: the whole suite through the server -----------------------------


def test_the_structured_output_suite_through_the_server(client):
    """Every case of jaxcb/bench/structured_suite.py (22 schemas, 5 regexes, 3 choices) as
    the openai client sends it (a schema as response_format json_schema, the rest in
    extra_body), streamed for every third: all parse and validate."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxcb.bench.structured_suite import MAX_TOKENS, cases, chat

    def ask(i_case):
        i, case = i_case
        so = case.structured_outputs
        kw = (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": so["json"]},
                }
            }
            if "json" in so
            else {"extra_body": {"structured_outputs": so}}
        )
        stream = i % 3 == 0
        out = client.chat.completions.create(
            model=NAME, messages=chat(case.prompt), max_tokens=MAX_TOKENS, temperature=0,
            stream=stream, **kw,
        )  # fmt: skip
        if not stream:
            return case, out.choices[0].message.content, out.choices[0].finish_reason
        text, finish = "", None
        for chunk in out:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return case, text, finish

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, enumerate(cases())))
    bad = {c.name: (t, c.check(t), f) for c, t, f in answers if c.check(t) or f != "stop"}
    assert len(answers) >= 30 and not bad
