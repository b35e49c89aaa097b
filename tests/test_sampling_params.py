"""SamplingParams: every invalid value is a ValueError that names the field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcb.sampling_params import SamplingParams

NAN, INF = math.nan, math.inf

INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("n", True),
    ("n", None),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.5),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("temperature", -0.1),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", True),
    ("temperature", "0.7"),
    ("temperature", None),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", False),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", NAN),
    ("top_p", True),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", NAN),
    ("seed", 1.0),
    ("seed", "42"),
    ("seed", True),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("stop_token_ids", "12"),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("presence_penalty", NAN),
    ("frequency_penalty", 3),
    ("frequency_penalty", -INF),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", INF),
    ("repetition_penalty", NAN),
    ("ignore_eos", "false"),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", None),
    ("skip_special_tokens", "yes"),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_names_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} ") as info:
        SamplingParams(**{name: value})
    assert repr(value) in str(info.value) or name in ("stop", "stop_token_ids")


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_validate_catches_values_set_after_construction(name: str, value: object) -> None:
    params = SamplingParams()
    setattr(params, name, value)
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} "):
        params.validate()


VALID = [
    ("n", 3),
    ("max_tokens", None),
    ("max_tokens", 1),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 2),
    ("top_k", -1),
    ("top_k", 0),
    ("top_k", 50),
    ("top_p", 1),
    ("top_p", 1e-9),
    ("min_p", 0),
    ("min_p", 1.0),
    ("seed", 0),
    ("seed", -7),
    ("seed", 2**70),
    ("logprobs", 0),
    ("logprobs", None),
    ("presence_penalty", -2),
    ("frequency_penalty", 2.0),
    ("repetition_penalty", 1e-3),
    ("stop_token_ids", (3, 4)),
    ("stop_token_ids", None),
    ("ignore_eos", True),
]


@pytest.mark.parametrize(("name", "value"), VALID, ids=[f"{n}={v!r}" for n, v in VALID])
def test_valid_values(name: str, value: object) -> None:
    params = SamplingParams(**{name: value})
    params.validate()


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 16, 1.0, 0, 1, 0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert not p.greedy and not p.uses_penalties and p.effective_top_k == 0


def test_stop_normalized_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(5,)).stop_token_ids == [5]


def test_derived_properties() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(top_k=7).effective_top_k == 7
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(
        [
            "n",
            "max_tokens",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "logprobs",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ]
    ),
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 70), 1 << 70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=4),
        st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=2), st.none()), max_size=3),
    ),
)
def test_any_value_is_accepted_or_a_value_error(name: str, value: object) -> None:
    """Never a TypeError: whatever a client sends is accepted or named in a ValueError."""
    try:
        SamplingParams(**{name: value})
    except ValueError as exc:
        assert f"SamplingParams.{name} " in str(exc)
