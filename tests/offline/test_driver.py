"""OfflineDriver with a fake engine: submissions follow the plan, wait for room and for a
leader's first token, every finished request reaches the caller once, and an engine that
can never make room is an error, not a hang."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxcb.offline.driver import OfflineDriver, decode_budget
from jaxcb.outputs import CompletionOutput, RequestOutput
from jaxcb.sampling_params import SamplingParams


class TwoStepEngine:
    """Each request yields one token in the step after it is added and finishes in the next."""

    max_model_len = 64

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            limits=SimpleNamespace(max_output_tokens=None),
            cache=SimpleNamespace(page_size=2, enable_prefix_caching=True),
        )
        self.age: dict[str, int] = {}
        self.most_at_once = 0
        self.log: list[tuple[str, str]] = []  # ("add" | "step", request id or "")

    def add_request(self, request_id: str) -> str:
        self.age[request_id] = 0
        self.most_at_once = max(self.most_at_once, len(self.age))
        self.log.append(("add", request_id))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.age)

    def step(self) -> list[RequestOutput]:
        self.log.append(("step", ""))
        outs = []
        for rid in list(self.age):
            self.age[rid] += 1
            done = self.age[rid] == 2
            tokens = [7] if self.age[rid] >= 1 else []
            outs.append(RequestOutput(rid, None, [], [CompletionOutput(0, "", tokens, None)], done))
            if done:
                del self.age[rid]
        return outs


def run(prompts, *, room: int) -> tuple[TwoStepEngine, list[str]]:
    engine = TwoStepEngine()
    finished: list[str] = []
    driver = OfflineDriver(
        engine,
        has_room=lambda: len(engine.age) < room,
        on_finished=lambda out: finished.append(out.request_id),
    )
    params = [SamplingParams(max_tokens=4)] * len(prompts)
    driver.submit_in_order(prompts, params, "prefix", lambda i, _: engine.add_request(str(i)))
    driver.drain()
    return engine, finished


def test_followers_wait_for_their_leaders_first_token() -> None:
    # 0 and 2 share the page (1, 1): 2 goes right after 0 in the plan, but only once 0 has
    # produced a token; 1 shares nothing and goes in between
    engine, finished = run([[1, 1, 5], [3, 3, 4], [1, 1, 6]], room=8)
    assert engine.log[:3] == [("add", "0"), ("add", "1"), ("step", "")]
    assert ("add", "2") in engine.log[3:]
    assert sorted(finished) == ["0", "1", "2"] and not engine.age


def test_room_bounds_what_is_in_the_engine() -> None:
    engine, finished = run([[i, i + 1] for i in range(0, 20, 2)], room=3)
    assert engine.most_at_once == 3
    assert sorted(finished, key=int) == [str(i) for i in range(10)]


def test_no_room_with_an_idle_engine_is_an_error() -> None:
    engine = TwoStepEngine()
    driver = OfflineDriver(engine, has_room=lambda: False, on_finished=lambda out: None)
    with pytest.raises(RuntimeError, match="idle engine"):
        driver.submit_in_order([[1, 2]], [SamplingParams()], "arrival", lambda i, _: "x")


def test_decode_budget_is_capped_by_the_context_and_counts_every_sample() -> None:
    engine = TwoStepEngine()
    assert decode_budget(engine, [1] * 60, SamplingParams(max_tokens=16, n=2)) == 8
    assert decode_budget(engine, [1] * 10, SamplingParams(max_tokens=16, n=2)) == 32
