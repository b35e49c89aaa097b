"""The latency targets of the "edf" policy arrive as extra_body fields of both endpoints
and become SamplingParams fields (the engine fills in its defaults: tests/engine/
test_admission.py); bad values are a 400 naming the field. No server process: the bodies
are parsed as the app parses them."""

from __future__ import annotations

import json

import pytest

from jaxcb.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body


def _params(body: dict, model: type = CompletionRequest):
    return parse_body(json.dumps(body).encode(), model).to_sampling_params()


def test_targets_reach_sampling_params_from_both_endpoints() -> None:
    params = _params({"prompt": "hi", "ttft_target_ms": 250, "tpot_target_ms": 40.5})
    assert (params.ttft_target_ms, params.tpot_target_ms) == (250, 40.5)
    chat = {"messages": [{"role": "user", "content": "hi"}], "ttft_target_ms": 1000.0}
    params = _params(chat, ChatCompletionRequest)
    assert (params.ttft_target_ms, params.tpot_target_ms) == (1000.0, None)
    assert _params({"prompt": "hi"}).ttft_target_ms is None  # the engine's default applies


@pytest.mark.parametrize(
    ("field", "value"), [("ttft_target_ms", 0), ("tpot_target_ms", -3), ("ttft_target_ms", "5")]
)
def test_bad_targets_are_a_400_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(APIError) as info:
        _params({"prompt": "hi", field: value})
    assert info.value.status_code == 400 and info.value.param == field
