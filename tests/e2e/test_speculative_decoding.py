"""Speculative decoding end to end on the built-in tiny model: proposals verified inside the
ordinary step give each request the tokens, logprobs and finish reasons it gets without them,
for greedy and seeded sampling (top-p, top-k), stop strings, stop tokens, max_tokens,
penalties, logprobs, n > 1 and prompt logprobs, on a pool small enough to preempt; every
page comes back; no step is compiled after warm-up.

The tiny model's random weights never repeat their input, so n-gram lookup would propose
nothing here: a replay proposer proposes each request's known output instead, with some
proposals spoiled, so rows are both kept and rejected. (tests/engine/test_speculative_
engine.py covers the n-gram proposer; tests/bench the real model.)
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.engine.groups import SEED_STRIDE
from jaxcb.engine.request import Request
from jaxcb.engine.spec import Proposer
from jaxcb.engine.spec.cost import SpeculationCost
from jaxcb.runtime import step as step_module

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 32, 64],
    max_model_len=256,
    page_size=8,
    num_pages=40,  # 320 tokens for 8 requests of up to ~140: preemption is routine
    speculative_config={"method": "ngram", "num_speculative_tokens": 3},
)


class ReplayProposer(Proposer):
    """Proposes what each request generated without speculation; every third proposal has
    its last token spoiled (and an unknown request gets nothing)."""

    def __init__(self, outputs: dict[tuple, list[int]], vocab_size: int) -> None:
        self.outputs, self.vocab_size, self.calls = outputs, vocab_size, 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        want = self.outputs.get(replay_key(request.prompt_token_ids, request.params, request.seed))
        assert want is not None, "a request the replay does not know"
        done = len(request.output_token_ids)
        proposal = list(want[done : done + max_tokens])
        self.calls += 1
        if proposal and self.calls % 3 == 0:
            proposal[-1] = (proposal[-1] + 1) % self.vocab_size
        return proposal


class AlwaysPropose(SpeculationCost):
    def best_cap(self, proposal_lengths, other_tokens, max_cap, draft_seconds=0.0, acceptance=None):
        return max_cap


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**CONFIG)


def prompts(n: int, seed: int, max_len: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(2, max_len, size=n)]


def run(llm: LLM, requests: list, proposer: Proposer | None) -> dict:
    """Step the engine to the end with `proposer` (None: speculation off), checking the page
    invariant after every step. Returns each request's final output by index."""
    engine = llm.engine
    llm.reset_prefix_cache()
    speculator = engine.speculator
    if proposer is None:
        engine.speculator = None
    else:
        speculator.proposer, speculator.cost = proposer, AlwaysPropose()
    try:
        ids = [engine.add_request(None, p, sp) for p, sp in requests]
        index = {rid: i for i, rid in enumerate(ids)}
        final: dict[int, object] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = index[out.request_id]
                assert i not in final, "an output after the request finished"
                if out.finished:
                    final[i] = out
            engine.check_page_invariant()
    finally:
        engine.speculator = speculator
    assert engine.pool.num_used == 0
    return final


def replay_key(prompt: list[int], params: SamplingParams, seed: int) -> tuple:
    """A sample's key: its prompt, and its seed where it has one of its own."""
    return tuple(prompt), None if params.seed is None else seed % (1 << 64)


def outcome(out) -> tuple:
    return tuple((tuple(o.token_ids), o.finish_reason, o.stop_reason, o.text) for o in out.outputs)


def test_verified_proposals_give_the_tokens_of_plain_decoding(llm):
    engine = llm.engine
    assert engine.async_scheduling  # (steps that propose wait for the one in flight)
    ps = prompts(8, seed=4)
    ref, ref3 = llm.generate(
        [ps[0], ps[3]], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False
    )
    stop_str = ref.text[10:12]
    assert len(stop_str) == 2 and len(ref3.token_ids) > 10
    requests = [
        (ps[0], SamplingParams(max_tokens=40, temperature=0, stop=[stop_str])),
        (ps[1], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, logprobs=1)),
        (ps[2], SamplingParams(max_tokens=7, temperature=0.7, top_k=20, seed=5)),
        (ps[3], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref3.token_ids[9]])),
        (ps[4], SamplingParams(max_tokens=25, temperature=1.0, seed=2, n=2)),
        (ps[5], SamplingParams(max_tokens=30, temperature=0.9, repetition_penalty=1.3, seed=1)),
        (ps[6], SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=2)),
        (ps[7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)),
    ]
    want = run(llm, requests, None)
    plain = llm.stats()
    outputs = {
        replay_key(prompt, params, (params.seed or 0) + j * SEED_STRIDE): list(o.token_ids)
        for i, (prompt, params) in enumerate(requests)
        for j, o in enumerate(want[i].outputs)
    }
    traces = step_module.TRACE_COUNT[0]
    got = run(llm, requests, ReplayProposer(outputs, engine.info.vocab_size))
    stats = llm.stats()
    assert step_module.TRACE_COUNT[0] == traces, "speculation compiled a step"
    spec, before = stats["spec_decode"], plain["spec_decode"]
    kept = spec["num_accepted_tokens"] - before["num_accepted_tokens"]
    proposed = spec["num_draft_tokens"] - before["num_draft_tokens"]
    assert 0.3 * proposed < kept < proposed  # kept and spoiled proposals
    assert stats["preemptions"] > plain["preemptions"] > 0  # both runs preempted
    assert stats["steps"] - plain["steps"] < 0.7 * plain["steps"]  # fewer steps
    assert want[0].finish_reason == "stop" and want[0].outputs[0].stop_reason == stop_str
    assert want[3].finish_reason == "stop"
    assert len({t for o in want.values() for t in o.token_ids}) > 40, "outputs too repetitive"
    for i in range(len(requests)):
        assert outcome(got[i]) == outcome(want[i]), f"request {i}"
        for g, w in zip(got[i].outputs, want[i].outputs, strict=True):
            np.testing.assert_allclose(g.logprobs or [], w.logprobs or [], atol=1e-4)
    for g, w in zip(got[6].prompt_logprobs[1:], want[6].prompt_logprobs[1:], strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_allclose(list(g.values()), list(w.values()), atol=1e-4)


class FixedProposer(Proposer):
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return self.tokens[:max_tokens] if len(request.output_token_ids) == 1 else []


def keep_rejected_proposals_half_the_time(real):
    """A deliberately wrong acceptance rule: a proposal the target's sample rejects is kept
    anyway, half the time (the rows after it were computed with it, so the rest goes on
    as if it had been accepted)."""
    rng = np.random.default_rng(0)

    def append_verified(self, req, group, result, row, drafts, now):
        result.token_ids = np.array(result.token_ids)
        for j, draft in enumerate(drafts):
            if result.token_ids[row + j] != draft and rng.random() < 0.5:
                result.token_ids[row + j] = draft
        return real(self, req, group, result, row, drafts, now)

    return append_verified


def test_speculative_sampling_draws_from_the_target_distribution(llm, monkeypatch):
    """Temperature 1 with top-p: the second and third tokens (the first a decode step
    verifies) of 800 samples with a fixed proposal and of 800 without cannot be told apart
    by a chi-square test; under a wrong acceptance rule they can."""
    from scipy.stats import chi2_contingency

    from jaxcb.engine.output_processor import OutputProcessor

    prompt = prompts(3, seed=7)[2]
    n = 800

    def draw(seed0: int, proposer: Proposer | None) -> np.ndarray:
        params = [
            SamplingParams(max_tokens=3, temperature=1, top_p=0.9, seed=seed0 + i, ignore_eos=True)
            for i in range(n)
        ]
        final = run(llm, list(zip([prompt] * n, params, strict=True)), proposer)
        return np.array([final[i].outputs[0].token_ids for i in range(n)])

    plain = draw(0, None)
    common = [int(np.bincount(plain[:, k]).argmax()) for k in (1, 2)]
    proposal = FixedProposer(common)

    def p_value(other: np.ndarray) -> float:
        """The smaller of the chi-square p-values of tokens 2 and 3 (the top 8 of the plain
        draws, the rest pooled) between the plain draws and `other`."""
        ps = []
        for k in (1, 2):
            top = np.argsort(np.bincount(plain[:, k]))[::-1][:8]
            table = [
                [*(np.sum(d[:, k] == t) for t in top), np.sum(~np.isin(d[:, k], top))]
                for d in (plain, other)
            ]
            ps.append(chi2_contingency(table).pvalue)
        return min(ps)

    before = llm.stats()["spec_decode"]["num_draft_tokens"]
    assert p_value(draw(10_000, proposal)) > 1e-3  # (0.19 when written)
    assert llm.stats()["spec_decode"]["num_draft_tokens"] - before >= n  # it did propose
    monkeypatch.setattr(
        OutputProcessor,
        "append_verified",
        keep_rejected_proposals_half_the_time(OutputProcessor.append_verified),
    )
    assert p_value(draw(20_000, proposal)) < 1e-6  # (3e-56 when written)


def test_the_server_streams_verified_tokens_and_counts_them(llm):
    """The OpenAI server on a speculating engine: a streamed completion (several tokens per
    step) is the plain one, and the spec_decode counters move."""
    import json
    import re

    from starlette.testclient import TestClient

    from jaxcb.server import ServerSettings, build_app

    prompt = prompts(1, seed=21)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = run(llm, [(prompt, params)], None)[0].outputs[0]
    speculator = llm.engine.speculator
    replay = {replay_key(prompt, params, 0): list(want.token_ids)}
    speculator.proposer = ReplayProposer(replay, llm.engine.info.vocab_size)
    speculator.cost = AlwaysPropose()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    app = build_app(llm.engine, ServerSettings(served_model_names=("tiny",)))
    with TestClient(app) as client:
        with client.stream(
            "POST", "/v1/completions", json={**body, "ignore_eos": True, "stream": True}
        ) as answer:
            assert answer.status_code == 200
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: {")]
        metrics = client.get("/metrics").text
    chunks = [json.loads(e)["choices"][0]["text"] for e in events]
    assert "".join(chunks) == want.text
    assert len(chunks) < len(want.token_ids)  # some events carried several tokens
    kept = re.search(r"jaxcb:spec_decode_num_accepted_tokens_total\{[^}]*\} ([\d.]+)", metrics)
    assert kept is not None and float(kept.group(1)) > 0, metrics
    assert llm.engine.pool.num_used == 0


def test_a_draft_model_s_guesses_give_the_tokens_of_plain_decoding(llm):
    """speculative_config "draft_model": the target's own checkpoint loaded as int8 drafts
    for it over KV pages of its own; greedy and seeded outputs are those without
    speculation (on a pool that preempts), every page of both pools comes back, and no
    step of either model compiles after warm-up."""
    spec = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}
    drafting = LLM(**CONFIG | {"speculative_config": spec})
    drafting.engine.speculator.cost = AlwaysPropose()
    proposer = drafting.engine.speculator.proposer
    ps = prompts(6, seed=31)
    requests = [
        (ps[0], SamplingParams(max_tokens=40, temperature=0)),
        (ps[1], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3)),
        (ps[2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)),
        (ps[3], SamplingParams(max_tokens=35, temperature=1.0, seed=8, n=2)),
        (ps[4], SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.2)),
        (ps[5], SamplingParams(max_tokens=12, temperature=0)),
    ]
    want = run(llm, requests, None)
    run(drafting, requests[:1], proposer)  # (warm-up: the draft's buckets run once)
    traces = step_module.TRACE_COUNT[0]
    got = run(drafting, requests, proposer)
    assert step_module.TRACE_COUNT[0] == traces, "a step compiled after warm-up"
    for i in range(len(requests)):
        assert outcome(got[i]) == outcome(want[i]), f"request {i}"
    spec_stats = drafting.stats()["spec_decode"]
    kept, proposed = spec_stats["num_accepted_tokens"], spec_stats["num_draft_tokens"]
    assert 0.2 * proposed < kept < proposed  # (135 of 336 when written: random weights)
    assert drafting.stats()["preemptions"] > 0
    assert proposer.pool.num_used == 0 and not proposer.sequences
