"""Fuzz: schemathesis against the server's own /openapi.json, /v1 routes only.

schemathesis generates bodies that fit the published request schemas and bodies that break
them (both modes, the default). Whatever arrives, the server must answer without a 5xx and
without hanging; afterwards it is healthy and idle. A dedicated server keeps every accepted
request cheap (small max_model_len, max_n and max_tokens caps), so the examples are bounded
in time as well as in number.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from server_helpers import MODEL, metric, request, wait_idle

schemathesis = pytest.importorskip("schemathesis")

CONFIG = {
    "model": "jaxcb-tiny-random-llama-v1",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "token_buckets": "16 64",
    "max_model_len": 128,
    "num_pages": 64,
    "max_n": 2,
    "max_output_tokens": 8,
    "max_waiting_requests": 64,
}
ARGS = [a for k, v in CONFIG.items() for a in (f"--{k.replace('_', '-')}", *str(v).split())]
MAX_EXAMPLES = int(os.environ.get("JAXCB_FUZZ_EXAMPLES", "150"))  # per route and mode
CALL_TIMEOUT = 30.0  # seconds; a request that takes longer counts as a hang


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    with start_server(ARGS) as srv:
        yield srv
        after = wait_idle(srv.url, timeout=30)
        assert metric(after, "jaxcb:request_success_total") > 0  # some fuzzed requests ran
        assert request("GET", srv.url + "/health")[0] == 200
        assert "Traceback" not in srv.log(), srv.tail()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json").include(
        path_regex="^/v1/"
    )


ROUTES = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET")]


def test_openapi_documents_the_request_bodies(fuzz_server):
    status, doc = request("GET", fuzz_server.url + "/openapi.json")
    assert status == 200
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["required"] is True
    components = doc["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage"} <= set(components)
    assert "priority" in components["CompletionRequest"]["properties"]


def test_limits_are_clear_errors_and_defaults_respect_them(fuzz_server):
    url = fuzz_server.url + "/v1/completions"
    base = {"model": MODEL, "prompt": [5, 6, 7], "ignore_eos": True}
    status, answer = request("POST", url, base)  # OpenAI's default max_tokens 16 > the cap
    assert status == 200 and answer["usage"]["completion_tokens"] == 8
    status, answer = request("POST", url, {**base, "max_tokens": 9})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert "max_output_tokens=8" in answer["error"]["message"]
    status, answer = request("POST", url, {**base, "n": 3})
    assert status == 400 and answer["error"]["param"] == "n" and "max_n=2" in str(answer)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    status, answer = request("POST", fuzz_server.url + "/v1/chat/completions", chat)
    assert status == 200 and answer["usage"]["completion_tokens"] == 8


# schemathesis' own pytest integration (`schemathesis.pytest.from_fixture`) does not work
# with pytest 9, so the test draws cases from its hypothesis strategies directly.
CASES = [(path, method, mode) for path, method in ROUTES for mode in ("positive", "negative")]
CASES.remove(("/v1/models", "GET", "negative"))  # it takes no input to break


@pytest.mark.parametrize(("path", "method", "mode"), CASES, ids=[f"{p}-{m}" for p, _, m in CASES])
def test_v1_routes_never_answer_5xx(api_schema, path, method, mode):
    strategy = api_schema[path][method].as_strategy(schemathesis.GenerationMode(mode))
    seen = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=os.environ.get("JAXCB_FUZZ_RANDOM") is None,
        database=None,
    )
    @given(case=strategy)
    def check(case) -> None:
        if mode == "positive" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # so that more cases get past the model check
        response = case.call(timeout=CALL_TIMEOUT)
        seen.append(response.status_code)
        assert response.status_code < 500, (
            f"{method} {path} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}"[:2000]
        )

    check()
    assert seen
