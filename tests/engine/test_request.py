"""Request: token bookkeeping and stop conditions."""

from __future__ import annotations

import pytest

from jaxcb.engine.request import Request, RequestStatus
from jaxcb.sampling_params import SamplingParams

EOS = 2


def make(prompt_len: int = 3, max_tokens: int = 5, **params: object) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, **params),
        seed=0,
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        arrival_time=0.0,
    )


def test_token_bookkeeping() -> None:
    r = make()
    assert r.status is RequestStatus.WAITING and r.num_tokens == r.num_prompt_tokens == 3
    assert r.num_uncomputed_tokens == 3 and not r.is_decoding
    r.num_computed_tokens = 3
    r.append_token(7)
    assert r.token_ids == [10, 11, 12, 7] and r.output_token_ids == [7]
    assert r.is_decoding and r.num_uncomputed_tokens == 1
    assert r.prompt_token_ids == [10, 11, 12]  # the prompt list is not aliased


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_reason"),
    [
        ({}, [5, EOS], "stop", None),
        ({"ignore_eos": True}, [5, EOS, 6, 7, 8], "length", None),
        ({"stop_token_ids": [6]}, [5, 6], "stop", 6),
        ({"ignore_eos": True, "stop_token_ids": [EOS]}, [EOS], "stop", EOS),
        ({}, [5, 6, 7, 8, 9], "length", None),
    ],
)
def test_stop_conditions(
    params: dict, tokens: list[int], reason: str, stop_reason: int | None
) -> None:
    r = make(**params)
    for i, t in enumerate(tokens):
        assert r.finish_reason is None, f"finished early, at token {i}"
        r.append_token(t)
        r.check_stop_tokens(max_model_len=100)
    assert (r.finish_reason, r.stop_reason) == (reason, stop_reason)


def test_max_model_len_ends_the_request() -> None:
    r = make(prompt_len=6, max_tokens=50)
    r.append_token(5)
    r.check_stop_tokens(max_model_len=8)
    assert r.finish_reason is None
    r.append_token(5)
    r.check_stop_tokens(max_model_len=8)
    assert r.finish_reason == "length" and r.num_tokens == 8
