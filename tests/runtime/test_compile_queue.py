"""The background compile (runtime/compile_queue.py, EngineConfig.compile_in_background):
the queue's order, a waited-for program first, a failed compile raised where it is needed;
an engine compiled that way gives the same tokens and traces nothing once it is done."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.runtime import step as step_module
from jaxcb.runtime.compile_queue import CompileQueue


def test_the_queue_compiles_in_order_and_a_waited_for_key_next():
    started, gate = threading.Event(), threading.Event()
    order: list[str] = []

    def compile_one(key: str) -> str:
        if key == "a":
            started.set()
            assert gate.wait(10)
        order.append(key)
        return key.upper()

    queue = CompileQueue(["a", "b", "c", "d"], compile_one)
    assert started.wait(10)
    assert queue.pending == 4 and not queue.done("d")
    queue.prioritize("d")  # "a" is compiling: "d" goes before "b" and "c"
    gate.set()
    assert queue.wait("d") == "D"
    assert queue.wait("c") == "C"
    assert order == ["a", "d", "b", "c"]
    assert queue.pending == 0 and queue.seconds > 0


def test_a_failed_compile_is_raised_in_the_step_that_needs_it_and_the_rest_compile():
    def compile_one(key: str) -> str:
        if key == "b":
            raise ValueError("no such program")
        return key.upper()

    queue = CompileQueue(["a", "b", "c"], compile_one)
    with pytest.raises(ValueError, match="no such program"):
        queue.wait("b")
    assert queue.wait("c") == "C"


def test_a_stopped_queue_fails_what_it_did_not_compile():
    started, gate = threading.Event(), threading.Event()

    def compile_one(key: str) -> str:
        started.set()
        assert gate.wait(10)
        return key

    queue = CompileQueue(["a", "b"], compile_one)
    assert started.wait(10)
    threading.Timer(0.2, gate.set).start()
    queue.stop(timeout=10)  # after "a", its current program
    assert queue.wait("a") == "a"
    with pytest.raises(RuntimeError, match="stopped"):
        queue.wait("b")


CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[8, 16, 32, 64],
    max_model_len=256,
    page_size=8,
    num_pages=64,
    compilation_cache="off",
)


def test_an_engine_compiled_in_the_background_gives_the_same_tokens_and_then_traces_nothing():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in (50, 3, 20, 7)]
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2),
    ]
    background = LLM(compile_in_background=True, **CONFIG)
    info = background.engine.info
    assert info.compile_cache["buckets_in_background"] == len(info.buckets) - 1
    # the first step's bucket (64 tokens) is one of the last queued: it is compiled first
    got = [o.token_ids for sp in params for o in background.generate(prompts, sp, use_tqdm=False)]

    deadline = time.monotonic() + 300
    while background.stats()["programs_compiling"] and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = background.stats()
    assert stats["programs_compiling"] == 0
    assert set(stats["compile_seconds_per_bucket"]) == {8, 16, 32, 64}
    assert stats["compile_seconds"] > info.compile_seconds  # the background's seconds count
    traces = step_module.TRACE_COUNT[0]
    again = [o.token_ids for sp in params for o in background.generate(prompts, sp, use_tqdm=False)]
    assert step_module.TRACE_COUNT[0] == traces, "the step function was traced again"
    assert again == got

    at_once = LLM(**CONFIG)
    assert at_once.stats()["programs_compiling"] == 0
    assert got == [
        o.token_ids for sp in params for o in at_once.generate(prompts, sp, use_tqdm=False)
    ]
