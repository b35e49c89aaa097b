"""Bad input gets its status code and OpenAI's error shape, never a 500, and changes nothing."""

from __future__ import annotations

import json

import pytest
from server_helpers import ENGINE_CONFIG, MODEL, metric, request, scrape, wait_idle

MAX_MODEL_LEN = ENGINE_CONFIG["max_model_len"]
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


def _chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": USER, **fields}).encode()


# (path, raw body, status, param) ; param None = not checked
TOOL_F = {"type": "function", "function": {"name": "f"}}
CASES = {
    # bodies that are not a JSON object
    "bad-json": (COMPLETIONS, b"{bad", 400, None),
    "empty-body": (COMPLETIONS, b"", 400, None),
    "json-array": (COMPLETIONS, b"[1, 2]", 400, None),
    "json-string": (CHAT, b'"hello"', 400, None),
    "not-utf8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    "nan": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "huge-float": (COMPLETIONS, b'{"prompt": "hi", "top_p": 1e400}', 400, "top_p"),
    # wrong types
    "prompt-int": (COMPLETIONS, json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    "prompt-missing": (COMPLETIONS, json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    "prompt-mixed": (COMPLETIONS, _completion(prompt=["a", [1, 2]]), 400, "prompt"),
    "max-tokens-str": (COMPLETIONS, _completion(max_tokens="16"), 400, "max_tokens"),
    "max-tokens-float": (COMPLETIONS, _completion(max_tokens=1.5), 400, "max_tokens"),
    "temperature-str": (COMPLETIONS, _completion(temperature="hot"), 400, "temperature"),
    "stream-str": (COMPLETIONS, _completion(stream="yes"), 400, "stream"),
    "seed-str": (COMPLETIONS, _completion(seed="x"), 400, "seed"),
    "stop-int": (COMPLETIONS, _completion(stop=5), 400, "stop"),
    "ignore-eos-int": (COMPLETIONS, _completion(ignore_eos=1), 400, "ignore_eos"),
    "messages-str": (CHAT, json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    "role-unknown": (CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), 400, None),
    "content-int": (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, None),
    "logprobs-str": (CHAT, _chat(logprobs="yes"), 400, "logprobs"),
    # invalid values
    "max-tokens-0": (COMPLETIONS, _completion(max_tokens=0), 400, "max_tokens"),
    "max-tokens-neg": (COMPLETIONS, _completion(max_tokens=-3), 400, "max_tokens"),
    "temperature-neg": (COMPLETIONS, _completion(temperature=-0.5), 400, "temperature"),
    "top-p-0": (COMPLETIONS, _completion(top_p=0), 400, "top_p"),
    "top-p-big": (COMPLETIONS, _completion(top_p=1.5), 400, "top_p"),
    "top-k-neg": (COMPLETIONS, _completion(top_k=-2), 400, "top_k"),
    "top-k-huge": (COMPLETIONS, _completion(top_k=2**40), 400, "top_k"),
    "min-p-big": (COMPLETIONS, _completion(min_p=2), 400, "min_p"),
    "n-0": (COMPLETIONS, _completion(n=0), 400, "n"),
    "n-huge": (COMPLETIONS, _completion(n=100_000), 400, "n"),
    "logprobs-21": (COMPLETIONS, _completion(logprobs=21), 400, "logprobs"),
    "logprobs-neg": (COMPLETIONS, _completion(logprobs=-1), 400, "logprobs"),
    "presence-3": (COMPLETIONS, _completion(presence_penalty=3), 400, "presence_penalty"),
    "frequency-neg3": (COMPLETIONS, _completion(frequency_penalty=-3), 400, "frequency_penalty"),
    "stop-empty": (COMPLETIONS, _completion(stop=[""]), 400, "stop"),
    "stream-options-no-stream": (
        COMPLETIONS,
        _completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    "echo-str": (COMPLETIONS, _completion(echo="yes"), 400, "echo"),
    "echo-logprobs-21": (COMPLETIONS, _completion(echo=True, logprobs=21), 400, "logprobs"),
    "echo-max-tokens-neg": (COMPLETIONS, _completion(echo=True, max_tokens=-1), 400, "max_tokens"),
    "prompt-empty-list": (COMPLETIONS, _completion(prompt=[]), 400, "prompt"),
    "prompt-empty-ids": (COMPLETIONS, _completion(prompt=[[]]), 400, "prompt"),
    "prompt-id-too-big": (COMPLETIONS, _completion(prompt=[1, 10**6]), 400, "prompt"),
    "prompt-id-neg": (COMPLETIONS, _completion(prompt=[-1]), 400, "prompt"),
    "prompt-id-2**70": (COMPLETIONS, _completion(prompt=[[1], [2**70]]), 400, "prompt"),
    "n-10**30": (COMPLETIONS, _completion(n=10**30), 400, "n"),
    "max-tokens-10**30": (COMPLETIONS, _completion(max_tokens=10**30), 400, "max_tokens"),
    "image-part": (
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        None,
    ),
    "messages-empty": (CHAT, _chat(messages=[]), 400, "messages"),
    "top-logprobs-alone": (CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    "top-logprobs-30": (CHAT, _chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    # tools: the tiny model's template renders none (and is no ChatML); malformed ones; a
    # tool_choice naming no tool, or needing tools that are not there; legacy functions
    "tools-not-rendered": (CHAT, _chat(tools=[TOOL_F]), 400, "tools"),
    "tools-malformed": (CHAT, _chat(tools=[{"type": "function"}]), 400, "tools"),
    "tool-choice-unknown": (
        CHAT,
        _chat(tools=[TOOL_F], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    "tool-choice-without-tools": (CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    "functions": (CHAT, _chat(functions=[{"name": "f"}]), 400, "functions"),
    "stream-bad-value": (CHAT, _chat(stream=True, temperature=-1), 400, "temperature"),
    # too long for max_model_len
    "prompt-too-long": (COMPLETIONS, _completion(prompt="x" * 600, max_tokens=1), 400, "prompt"),
    "default-max-tokens-overflows": (COMPLETIONS, _completion(prompt="x" * 500), 400, "max_tokens"),
    "chat-max-tokens-overflows": (CHAT, _chat(max_tokens=10_000), 400, "max_tokens"),
    # a request's fan-out (issue 15): prompts at most max_prompts_per_request (128), and
    # prompts x n at most max_waiting_requests (1024), whatever is waiting
    "prompts-over-cap": (COMPLETIONS, _completion(prompt=["x"] * 129), 400, "prompt"),
    "fan-out-over-queue": (COMPLETIONS, _completion(prompt=["x"] * 9, n=128), 400, "n"),
    # priority is refused by name under the fcfs policy
    "priority-under-fcfs": (COMPLETIONS, _completion(priority=3), 400, "priority"),
    # unknown model / route / method
    "model-unknown": (COMPLETIONS, _completion(model="gpt-4"), 404, "model"),
    "chat-model-unknown": (CHAT, _chat(model="gpt-4", stream=True), 404, "model"),
}


def _check_error_shape(body: object, status: int) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


@pytest.fixture(scope="module")
def counters_before(server):
    return scrape(server.url)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input(server, counters_before, case):
    path, body, want_status, want_param = CASES[case]
    status, answer = request("POST", server.url + path, body)
    assert status == want_status, answer
    error = _check_error_shape(answer, status)
    if want_param is not None:
        assert error["param"] == want_param, error


def test_too_long_message_states_both_numbers(server):
    status, answer = request("POST", server.url + COMPLETIONS, _completion(max_tokens=600))
    assert status == 400
    message = answer["error"]["message"]
    # "hi" is 3 tokens with BOS: the message names the prompt, max_tokens and the limit
    assert "3" in message and "600" in message and str(MAX_MODEL_LEN) in message, message

    status, answer = request(
        "POST", server.url + COMPLETIONS, _completion(prompt="x" * 600, max_tokens=1)
    )
    assert status == 400
    message = answer["error"]["message"]
    assert "601" in message and str(MAX_MODEL_LEN) in message, message


@pytest.mark.parametrize(
    ("method", "path", "want"),
    [("GET", "/v1/nothing", 404), ("GET", COMPLETIONS, 405), ("DELETE", "/v1/models", 405)],
)
def test_unknown_routes_answer_in_error_shape(server, method, path, want):
    status, answer = request(method, server.url + path)
    assert status == want
    _check_error_shape(answer, status)


def test_bad_input_changed_nothing(server, counters_before):
    after = wait_idle(server.url)
    for name in ("jaxcb:prompt_tokens_total", "jaxcb:request_success_total"):
        assert metric(after, name) == metric(counters_before, name), name
    status, _ = request("GET", server.url + "/health")
    assert status == 200
