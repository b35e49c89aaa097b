"""Async scheduling on the host side (engine/inflight.py), with a fake device (no jax).

The fake device runs each step when it is dispatched, as a real one runs them in dispatch
order: it writes the K/V slots of every chunk (slot -> the token prefix its K/V encode) and
checks that every earlier slot a chunk reads holds the chunk's own prefix, so a page freed
while a step that writes it is in flight, or a cached page registered from a dropped token,
would show. Every input token must be on the host or linked to the row of the step in flight
that samples it. The token sampled at position p is a function of (prompt, p), so each
request's output is known in advance: random workloads on tight pools (preemption), with
prefix sharing, stops, max_tokens, penalties and aborts, must give exactly it, with async
scheduling on and off.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
from helpers import FakeRunnerBase, fake_engine_info

from jaxcb.config import EngineConfig
from jaxcb.engine.interface import StepResult
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.sampling_params import SamplingParams

EOS = 2
MAX_MODEL_LEN = 40


def fake_token(prompt: list[int], position: int, eos_every: int) -> int:
    h = (sum(prompt[:4]) * 1_000_003 + len(prompt) * 31 + position * 7_919 + 12_345) % 65_521
    if eos_every and h % eos_every == 0:
        return EOS
    return 3 + h % 40


def expected_output(prompt: list[int], params: SamplingParams, max_tokens: int, eos: int) -> list:
    """What the request generates alone: up to a stop token, EOS or its length limits."""
    out: list[int] = []
    while True:
        token = fake_token(prompt, len(prompt) + len(out), eos)
        out.append(token)
        if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
            return out
        if len(out) >= max_tokens or len(prompt) + len(out) >= MAX_MODEL_LEN:
            return out


class FakeDevice(FakeRunnerBase):
    """The device side, faked; see the module docstring."""

    def __init__(self, engine_ref: list[LLMEngine], page_size: int, eos_every: int) -> None:
        self.engine_ref, self.page_size, self.eos_every = engine_ref, page_size, eos_every
        self.kv: dict[int, tuple[int, ...]] = {}
        self.rows: dict[int, tuple[int, int, int]] = {}  # row -> (id(request), position, token)
        self.num_linked = 0

    def dispatch(self, bucket: object, sched: SchedulerOutput) -> np.ndarray:
        ps, prev, self.rows = self.page_size, self.rows, {}
        holders = Counter(p for pages in self.engine_ref[0].scheduler.owners() for p in pages)
        tokens = []
        for s, chunk in enumerate(sched.chunks):
            req = chunk.request
            ids = list(req.token_ids[: chunk.end])
            if chunk.prev_sample_row >= 0:
                assert not req.params.uses_penalties, "penalties must read their history here"
                who, position, token = prev[chunk.prev_sample_row]
                assert (who, position) == (id(req), chunk.end - 1), "linked to the wrong row"
                assert len(ids) == chunk.end - 1
                ids.append(token)
                self.num_linked += 1
            assert len(ids) == chunk.end, f"request {req.request_id}: an input token is missing"
            for pos in range(chunk.end):
                page = req.page_ids[pos // ps]
                slot = page * ps + pos % ps
                if pos < chunk.start:
                    assert self.kv.get(slot) == tuple(ids[: pos + 1]), (
                        f"request {req.request_id} reads position {pos} of another prefix"
                    )
                else:
                    assert holders[page] == 1, f"page {page} written while shared"
                    self.kv[slot] = tuple(ids[: pos + 1])
            token = fake_token(req.prompt_token_ids, chunk.end, self.eos_every)
            tokens.append(token)
            self.rows[s] = (id(req), chunk.end, token)
        return np.array(tokens, np.int32)

    def collect(self, tokens: np.ndarray) -> StepResult:
        return StepResult(tokens, np.zeros(len(tokens), np.float32), None, None)

    def execute(self, bucket: object, sched: SchedulerOutput) -> StepResult:
        return self.collect(self.dispatch(bucket, sched))


def fake_engine(eos_every: int = 0, **flat: object) -> tuple[LLMEngine, FakeDevice]:
    flat = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "page_size": 4, **flat}
    config = EngineConfig.from_dict(model="fake", **flat)
    info = fake_engine_info(
        config,
        max_model_len=MAX_MODEL_LEN,
        token_buckets=(8, config.scheduler.max_num_batched_tokens),
    )
    ref: list[LLMEngine] = []
    device = FakeDevice(ref, config.cache.page_size, eos_every)
    engine = LLMEngine(config, runner=device, info=info, tokenizer=None, eos_token_ids=[EOS])
    ref.append(engine)
    return engine, device


def workload(seed: int) -> tuple[dict, list[tuple[int, list[int], SamplingParams, int | None]]]:
    """An engine config and requests (arrival step, prompt, params, abort step or None)."""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([2, 4]))
    config = dict(
        page_size=page_size,
        num_pages=MAX_MODEL_LEN // page_size + int(rng.integers(0, 12)),  # tight: preempts
        max_num_seqs=int(rng.integers(1, 6)),
        enable_prefix_caching=bool(rng.integers(0, 2)),
        long_prefill_token_threshold=int(rng.choice([0, 0, 6])),
        watermark=0,
    )
    families = [rng.integers(3, 90, size=12).tolist() for _ in range(2)]
    requests = []
    for _ in range(int(rng.integers(3, 12))):
        length = int(rng.integers(1, 24))
        own = rng.integers(3, 90, size=length).tolist()
        shared = int(rng.integers(0, length + 1)) if rng.random() < 0.5 else 0
        prompt = (families[int(rng.integers(0, 2))][:shared] + own)[:length]
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 20)),
            temperature=0,
            ignore_eos=bool(rng.random() < 0.3),
            stop_token_ids=[int(rng.integers(3, 43))] if rng.random() < 0.3 else [],
            presence_penalty=0.5 if rng.random() < 0.15 else 0.0,
        )
        abort = int(rng.integers(0, 30)) if rng.random() < 0.2 else None
        requests.append((int(rng.integers(0, 12)), prompt, params, abort))
    return config, requests


def run(engine: LLMEngine, requests: list, eos_every: int) -> dict[str, tuple[list, str]]:
    """Step to the end with arrivals and aborts at their steps; checks the page invariant
    after every step and each streamed output against the request's known output."""
    ids: dict[int, str] = {}
    want: dict[str, list[int]] = {}
    final: dict[str, tuple[list, str]] = {}
    step = 0
    while step <= 12 or engine.has_unfinished_requests():
        for i, (arrival, prompt, params, abort) in enumerate(requests):
            if arrival == step:
                ids[i] = rid = engine.add_request(None, prompt, params)
                cap = min(params.max_tokens, MAX_MODEL_LEN - len(prompt))
                want[rid] = expected_output(prompt, params, cap, eos_every)
            if abort is not None and i in ids and arrival + abort == step:
                out = engine.abort_request(ids[i])
                if out is not None:
                    final[ids[i]] = (list(out.outputs[0].token_ids), "abort")
        for out in engine.step():
            assert out.request_id not in final, "an output after the request finished"
            tokens = list(out.outputs[0].token_ids)
            assert tokens == want[out.request_id][: len(tokens)]
            if out.finished:
                final[out.request_id] = (tokens, out.outputs[0].finish_reason)
        engine.check_page_invariant()
        step += 1
        assert step < 2_000, "the engine did not finish"
    assert engine.pool.num_used == 0
    groups = engine.output_processor.groups.values()
    assert all(r.num_inflight == 0 for g in groups for r in g.children)
    for rid, (tokens, reason) in final.items():
        if reason != "abort":
            assert tokens == want[rid], f"request {rid}"
    return final


@pytest.mark.parametrize("seed", range(40))
def test_async_scheduling_gives_the_tokens_of_sync(seed: int) -> None:
    config, requests = workload(seed)
    eos_every = [0, 7, 13][seed % 3]
    sync, _ = fake_engine(eos_every, async_scheduling=False, **config)
    overlapped, device = fake_engine(eos_every, async_scheduling=True, **config)
    assert overlapped.async_scheduling and not sync.async_scheduling
    want = run(sync, requests, eos_every)
    got = run(overlapped, requests, eos_every)
    done = {rid for rid in want if want[rid][1] != "abort" and got[rid][1] != "abort"}
    assert {rid: got[rid] for rid in done} == {rid: want[rid] for rid in done}
    assert device.num_linked > 0 or overlapped.stats()["steps"] < 3
    assert overlapped._inflight is None


def test_a_stop_on_the_token_in_flight_drops_the_next_one_and_frees_the_pages() -> None:
    """Request 0 stops on its third token (a stop token): the step after it, already
    dispatched, computed a fourth, which is never appended nor streamed."""
    engine, device = fake_engine(async_scheduling=True, num_pages=20)
    prompt = [5, 6, 7]
    third = fake_token(prompt, len(prompt) + 2, 0)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[third])
    assert third not in [fake_token(prompt, len(prompt) + i, 0) for i in range(2)]
    rid = engine.add_request(None, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        engine.check_page_invariant()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids[-1] == third
    assert len(outputs[-1].outputs[0].token_ids) == 3 and outputs[-1].request_id == rid
    assert device.num_linked >= 3  # the dropped token's step was linked too
    assert engine.pool.num_used == 0 and engine._inflight is None
    stats = engine.stats()
    assert stats["generated_tokens"] == 3 and stats["async_scheduling"] is True


def test_max_tokens_is_never_scheduled_past() -> None:
    engine, _ = fake_engine(async_scheduling=True, num_pages=20)
    engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # one prefill step, then decodes for tokens 2..4: never a step for a fifth token
    assert engine.stats()["steps"] == 4
    assert engine.stats()["generated_tokens"] == 4


def test_penalties_wait_for_their_tokens() -> None:
    engine, _ = fake_engine(async_scheduling=True, num_pages=20)
    engine.add_request(None, [5, 6], SamplingParams(max_tokens=5, presence_penalty=1.0))
    engine.add_request(None, [7, 8], SamplingParams(max_tokens=5))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["async_drains"] >= 4  # FakeDevice asserts the rest


@pytest.mark.parametrize(
    ("flat", "reason"),
    [
        ({"itl_target_ms": 50.0}, "itl_target_ms"),
        ({"preemption_mode": "swap"}, "preemption_mode='swap'"),
        ({"batching": "static"}, "batching='static'"),
    ],
)
def test_engines_that_cannot_overlap_run_synchronously(flat: dict, reason: str) -> None:
    engine, _ = fake_engine(async_scheduling=True, num_pages=20, **flat)
    assert not engine.async_scheduling and not engine.stats()["async_scheduling"]
    with pytest.raises(ValueError, match=reason):
        engine.async_scheduling = True


def test_async_scheduling_is_on_by_default_where_the_engine_can_overlap(caplog) -> None:
    """Unset (None): on, or off without a word where the engine cannot overlap; `true` where
    it cannot: off with a warning; `false`: off."""
    assert fake_engine(num_pages=20)[0].async_scheduling
    assert not fake_engine(async_scheduling=False, num_pages=20)[0].async_scheduling
    with caplog.at_level(logging.WARNING, logger="jaxcb.engine.llm_engine"):
        quiet, _ = fake_engine(num_pages=20, itl_target_ms=50.0)
    assert not quiet.async_scheduling and "async_scheduling is off" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="jaxcb.engine.llm_engine"):
        asked, _ = fake_engine(async_scheduling=True, num_pages=20, itl_target_ms=50.0)
    assert not asked.async_scheduling and "async_scheduling is off" in caplog.text


def test_switching_waits_for_nothing_in_flight() -> None:
    engine, _ = fake_engine(async_scheduling=False, num_pages=20)
    engine.async_scheduling = True
    engine.add_request(None, [5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.async_scheduling = False
    while engine.has_unfinished_requests():
        engine.step()
    engine.async_scheduling = False
    assert not engine.async_scheduling
