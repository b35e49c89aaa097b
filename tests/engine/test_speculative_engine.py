"""Speculative decoding on the host side (engine/spec/, the scheduler's proposal rows,
OutputProcessor.append_verified), with a fake device (no jax).

The fake target's next token is a function of the whole prefix it is fed, proposals
included, and mostly of its last two tokens, so outputs repeat and n-gram proposals are
often right and sometimes wrong. The fake device checks what a real one relies on: every
K/V slot a chunk reads before its first fed position holds the chunk's own prefix (a
rejected proposal's K/V read later would show), nothing is written into a shared page, and
each proposal's row samples after the prefix that ends with it. Random workloads on tight
pools (preemption), with prefix sharing, stops and aborts, must give each request exactly
the tokens it generates alone, free every page, and keep some proposals.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import FakeRunnerBase, fake_engine_info

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import make_buckets
from jaxcb.engine.interface import StepResult
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.engine.sched.schedule import SchedulerOutput, sample_row_starts
from jaxcb.engine.spec import DraftModel
from jaxcb.engine.spec.cost import SpeculationCost
from jaxcb.engine.spec.ngram import NgramIndex
from jaxcb.sampling_params import SamplingParams

EOS = 2
MAX_MODEL_LEN = 96


def next_token(prefix: list[int], eos_every: int) -> int:
    """The fake target's greedy token after `prefix`."""
    a, b = (prefix[-2], prefix[-1]) if len(prefix) > 1 else (0, prefix[-1])
    h = sum((i + 1) * t for i, t in enumerate(prefix)) % 9_973
    if eos_every and h % eos_every == 0:
        return EOS
    if h % 13 == 0:  # now and then, a turn the last two tokens do not predict
        return 3 + h % 40
    return 3 + (a * 7 + b * 13) % 11


def generate_alone(prompt: list[int], params: SamplingParams, eos_every: int) -> list[int]:
    seq, out = list(prompt), []
    cap = min(params.max_tokens, MAX_MODEL_LEN - len(prompt))
    while True:
        token = next_token(seq, eos_every)
        seq.append(token)
        out.append(token)
        if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
            return out
        if len(out) >= cap:
            return out


class FakeTarget(FakeRunnerBase):
    """The device side, faked; see the module docstring."""

    def __init__(self, engine_ref: list[LLMEngine], page_size: int, eos_every: int) -> None:
        self.engine_ref, self.page_size, self.eos_every = engine_ref, page_size, eos_every
        self.kv: dict[int, tuple[int, ...]] = {}
        self.num_rows = Counter[str]()
        self.last_tokens: list[int] = []  # the last step's sampled tokens, by row

    def prepare(self, sched: SchedulerOutput, bucket: object) -> SchedulerOutput:
        assert sched.num_sample_rows <= bucket.num_seqs, "the bucket lacks sampling rows"
        return sched

    def execute(self, bucket: object, sched: SchedulerOutput) -> StepResult:
        return self.collect(self.dispatch(bucket, sched))

    def collect(self, result: StepResult) -> StepResult:
        return result

    def dispatch(self, bucket: object, sched: SchedulerOutput) -> StepResult:
        """Runs the step at once (a device runs its steps in dispatch order); every input
        token must be on the host: no step verifies proposals, or proposes, linked to one
        in flight."""
        ps = self.page_size
        holders = Counter(p for pages in self.engine_ref[0].scheduler.owners() for p in pages)
        tokens = []
        starts = sample_row_starts(sched.chunks)
        for chunk, first_row in zip(sched.chunks, starts, strict=True):
            req, drafts = chunk.request, list(chunk.draft_token_ids)
            assert len(tokens) == first_row
            real_end = chunk.end - len(drafts)
            assert chunk.prev_sample_row < 0 or not drafts, "proposals after a token in flight"
            if drafts:
                assert real_end == req.num_tokens == chunk.start + 1, "proposals follow a decode"
            seq = list(req.token_ids[:real_end]) + drafts
            if chunk.prev_sample_row >= 0:  # its newest token, sampled by the step in flight
                assert len(seq) == chunk.end - 1
                seq.append(self.last_tokens[chunk.prev_sample_row])
                self.num_rows["linked"] += 1
            assert len(seq) == chunk.end
            for pos in range(chunk.end):
                page = req.page_ids[pos // ps]
                slot = page * ps + pos % ps
                if pos < chunk.start:
                    assert self.kv.get(slot) == tuple(seq[: pos + 1]), (
                        f"request {req.request_id} reads position {pos} of another prefix"
                    )
                else:
                    assert holders[page] == 1, f"page {page} written while shared"
                    self.kv[slot] = tuple(seq[: pos + 1])
            for j in range(1 + len(drafts)):
                tokens.append(next_token(seq[: real_end + j], self.eos_every))
            self.num_rows["proposal" if drafts else "plain"] += 1 + len(drafts)
        self.last_tokens = tokens
        return StepResult(np.array(tokens, np.int32), np.zeros(len(tokens), np.float32), None, None)


def draft_token(prefix: list[int], eos_every: int) -> int:
    """The fake draft's greedy token after `prefix`: the target's, but for a prefix in 5."""
    token = next_token(prefix, eos_every)
    return token if sum(prefix) % 5 else 3 + (token + 1) % 40


class FakeDraft(FakeRunnerBase):
    """A draft model's device side, faked: each position it reads before a chunk's first
    fed one must hold the K/V of the chunk's own prefix (its pages are its own pool's)."""

    def __init__(self, page_size: int, eos_every: int) -> None:
        self.page_size, self.eos_every = page_size, eos_every
        self.kv: dict[int, tuple[int, ...]] = {}
        self.num_steps = 0

    def execute(self, bucket: object, sched: SchedulerOutput) -> StepResult:
        assert sched.num_tokens <= bucket.num_tokens and len(sched.chunks) <= bucket.num_seqs
        assert sched.num_sample_rows == len(sched.chunks), "a draft step has no proposals"
        self.num_steps += 1
        ps, tokens = self.page_size, []
        for chunk in sched.chunks:
            req = chunk.request
            seq = list(req.token_ids[: chunk.end])
            for pos in range(chunk.end):
                slot = req.page_ids[pos // ps] * ps + pos % ps
                if pos < chunk.start:
                    assert self.kv.get(slot) == tuple(seq[: pos + 1]), "draft K/V of another prefix"
                else:
                    self.kv[slot] = tuple(seq[: pos + 1])
            tokens.append(draft_token(seq, self.eos_every) if chunk.samples else -1)
        return StepResult(np.array(tokens, np.int32), np.zeros(len(tokens), np.float32), None, None)


def fake_engine(eos_every: int = 0, **flat: object) -> tuple[LLMEngine, FakeTarget]:
    draft_pages = flat.pop("draft_pages", None)
    flat = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "page_size": 4, **flat}
    config = EngineConfig.from_dict(model="fake", **flat)
    info = fake_engine_info(
        config,
        max_model_len=MAX_MODEL_LEN,
        token_buckets=(8, config.scheduler.max_num_batched_tokens),
    )
    ref: list[LLMEngine] = []
    device = FakeTarget(ref, config.cache.page_size, eos_every)
    draft = None
    if config.speculative_config.method == "draft_model":
        draft = DraftModel(
            runner=FakeDraft(config.cache.page_size, eos_every),
            buckets=make_buckets((8, 16), config.scheduler.max_num_seqs),
            page_size=config.cache.page_size,
            num_pages=draft_pages or config.cache.num_pages,
        )
    engine = LLMEngine(
        config, runner=device, info=info, tokenizer=None, eos_token_ids=[EOS], draft=draft
    )
    ref.append(engine)
    if engine.speculator is not None:  # (a fake device's seconds say nothing)
        engine.speculator.cost = OnAndOff()
    return engine, device


class OnAndOff(SpeculationCost):
    """Proposals pay for 5 decisions, then not for 2, and so on: an async engine goes from
    waiting for each step (proposing) to overlapping them (turned down) and back."""

    calls = 0

    def best_cap(self, proposal_lengths, other_tokens, max_cap, draft_seconds=0.0, acceptance=None):
        if acceptance is not None:  # (whether proposals always kept would pay: yes)
            return max_cap
        self.calls += 1
        return max_cap if self.calls % 7 < 5 else 0


def workload(seed: int) -> tuple[dict, list[tuple[int, list[int], SamplingParams, int | None]]]:
    """An engine config and requests (arrival step, prompt, params, abort step or None)."""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([2, 4]))
    config = dict(
        page_size=page_size,
        num_pages=MAX_MODEL_LEN // page_size + int(rng.integers(0, 16)),  # tight: preempts
        max_num_seqs=int(rng.integers(1, 6)),
        enable_prefix_caching=bool(rng.integers(0, 2)),
        long_prefill_token_threshold=int(rng.choice([0, 0, 6])),
        preemption_mode=str(rng.choice(["recompute", "swap"])),
        watermark=0,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": int(rng.integers(1, 6)),
            "prompt_lookup_min": 2,
            "prompt_lookup_max": int(rng.integers(2, 4)),
        }
        if seed % 2
        else {"model": "fake-draft", "num_speculative_tokens": int(rng.integers(1, 6))},
    )
    if seed % 4 == 0:  # a draft pool too small for every request: some go without guesses
        config["draft_pages"] = MAX_MODEL_LEN // page_size
    requests = []
    for _ in range(int(rng.integers(2, 10))):
        # (a prompt the fake target would write: its output goes on as it does)
        prompt, length = rng.integers(3, 14, size=2).tolist(), int(rng.integers(2, 20))
        while len(prompt) < length:
            prompt.append(next_token(prompt, 0))
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 30)),
            temperature=0,
            ignore_eos=bool(rng.random() < 0.3),
            stop_token_ids=[int(rng.integers(3, 14))] if rng.random() < 0.3 else [],
        )
        abort = int(rng.integers(0, 30)) if rng.random() < 0.15 else None
        requests.append((int(rng.integers(0, 10)), prompt, params, abort))
    return config, requests


def run(engine: LLMEngine, requests: list, eos_every: int) -> dict[str, tuple[list, str]]:
    """Step to the end with arrivals and aborts at their steps; checks the page invariant
    after every step and each streamed output against the request's own output."""
    ids: dict[int, str] = {}
    want: dict[str, list[int]] = {}
    final: dict[str, tuple[list, str]] = {}
    step = 0
    while step <= 10 or engine.has_unfinished_requests():
        for i, (arrival, prompt, params, abort) in enumerate(requests):
            if arrival == step:
                ids[i] = rid = engine.add_request(None, prompt, params)
                want[rid] = generate_alone(prompt, params, eos_every)
            if abort is not None and i in ids and arrival + abort == step:
                out = engine.abort_request(ids[i])
                if out is not None:
                    final[ids[i]] = (list(out.outputs[0].token_ids), "abort")
        for out in engine.step():
            assert out.request_id not in final, "an output after the request finished"
            tokens = list(out.outputs[0].token_ids)
            assert tokens == want[out.request_id][: len(tokens)], f"request {out.request_id}"
            if out.finished:
                final[out.request_id] = (tokens, out.outputs[0].finish_reason)
        engine.check_page_invariant()
        step += 1
        assert step < 2_000, "the engine did not finish"
    assert engine.pool.num_used == 0
    for rid, (tokens, reason) in final.items():
        if reason != "abort":
            assert tokens == want[rid], f"request {rid}"
    return final


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_proposals_keep_every_request_s_own_tokens(async_scheduling: bool) -> None:
    """Async scheduling runs only where the workload's preemption mode lets it (recompute);
    proposals there wait for the step in flight, and the step after them for their tokens."""
    accepted = proposed = linked = 0
    for seed in range(40):
        config, requests = workload(seed)
        eos_every = [0, 11, 23][seed % 3]
        for on in (True, False):
            flat = dict(config, async_scheduling=async_scheduling)
            if not on:
                flat["speculative_config"] = {"method": "none"}
            engine, device = fake_engine(eos_every, **flat)
            assert engine.async_scheduling == (async_scheduling and not engine.swapper)
            run(engine, requests, eos_every)
            if on and engine.config.speculative_config.method == "draft_model":
                proposer = engine.speculator.proposer
                assert proposer.draft.runner.num_steps > 0
                assert proposer.pool.num_used == 0 and not proposer.sequences  # all dropped
            if on:
                linked += device.num_rows["linked"]
                spec = engine.stats()["spec_decode"]
                accepted += spec["num_accepted_tokens"]
                proposed += spec["num_draft_tokens"]
            else:
                assert device.num_rows["proposal"] == 0
    assert 0.2 < accepted / proposed < 0.95, (accepted, proposed)  # kept and rejected ones
    assert (linked > 0) == async_scheduling  # steps overlapped while proposals were off


def test_each_kept_proposal_saves_a_single_stream_a_step() -> None:
    prompt = [5, 6]
    while len(prompt) < 40:
        prompt.append(next_token(prompt, 0))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    steps, kept = {}, {}
    for method in ("ngram", "none"):
        engine, _ = fake_engine(speculative_config={"method": method}, num_pages=40)
        assert run(engine, [(0, prompt, params, None)], 0)
        steps[method] = engine.stats()["steps"]
        kept[method] = engine.stats()["spec_decode"]["num_accepted_tokens"]
    assert kept["ngram"] >= 10 and kept["none"] == 0
    assert steps["none"] - steps["ngram"] == kept["ngram"]


def test_proposals_have_rows_of_their_own() -> None:
    """max_num_seqs requests all propose in one step: the buckets hold their rows, and
    a full batch leaves none of its own to the proposals."""
    config = dict(
        max_num_seqs=2,
        max_num_batched_tokens=32,
        num_pages=60,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    engine, _ = fake_engine(**config)
    assert max(b.num_seqs for b in engine.info.buckets) == 10
    prompt = [5, 6]
    while len(prompt) < 30:
        prompt.append(next_token(prompt, 0))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.record_steps()
    run(engine, [(0, prompt, params, None), (0, prompt[1:], params, None)], 0)
    both = [r for r in engine.pop_step_records() if len(r.chunks) == 2 and r.num_tokens > 4]
    assert any(r.num_tokens >= 6 and all(c[2] == "decode" for c in r.chunks) for r in both)


def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    index.update(tokens)
    assert index.lookup(tokens, 3) == [4, 5, 7]  # "2 3" last came before "4 5 7"
    assert index.lookup([*tokens, 8], 3) == []  # 8 was never seen before
    index.update([*tokens, 4])
    assert index.lookup([*tokens, 4], 2) == [5, 7]  # "2 3 4": the longest match
    assert NgramIndex(2, 2).lookup([1], 4) == []


def test_speculation_cost_turns_proposals_down_for_a_compute_bound_batch() -> None:
    cost = SpeculationCost(prior_acceptance=0.5)
    assert cost.best_cap([4] * 64, 0, 4) == 4  # nothing measured yet: try
    for tokens in (1, 5, 64, 320, 512):  # weight-bound floor, then ~0.2 ms a token
        cost.observe_step(tokens, 0.007 + 0.0002 * tokens)
    assert cost.best_cap([4], 0, 4) == 4  # a single stream: nearly free
    assert cost.best_cap([4] * 64, 0, 4) == 0  # 64 decodes: more rows than tokens they bring
    for _ in range(200):
        cost.observe_verified(4, 4)  # every proposal kept
    assert cost.acceptance > 0.9 and cost.best_cap([4] * 64, 0, 4) == 4


def test_a_draft_model_s_steps_count_against_its_guesses() -> None:
    """Each guessed position costs a draft step: guesses nearly as dear as the target's
    step never pay (and are not even explored), a draft a few times cheaper does; an
    async engine's faster steps without proposals count against them too."""
    from jaxcb.config import SpeculativeConfig
    from jaxcb.engine.request import Request
    from jaxcb.engine.spec import Proposer, Speculator

    cost = SpeculationCost(prior_acceptance=0.9)
    for tokens in (1, 5):
        cost.observe_step(tokens, 0.006 + 0.0001 * tokens)
    assert cost.best_cap([4], 0, 4) == 4  # guesses that cost nothing
    assert cost.best_cap([4], 0, 4, draft_seconds=0.006) == 0
    assert cost.best_cap([4], 0, 4, draft_seconds=0.001) == 4
    assert cost.best_cap([4], 0, 4, draft_seconds=0.003) > 0
    for _ in range(100):  # plain steps at 0.6x the fit (overlapped), guessing ones as fit
        cost.observe_cadence(1, 0.0, False, 0.6 * 0.0061)
        cost.observe_cadence(5, 0.012, True, 0.0065 + 0.012)
    assert cost.best_cap([4], 0, 4, draft_seconds=0.003) == 0

    class Guesser(Proposer):
        runs_a_model = True
        seconds_per_guess = 0.0

        def propose(self, request: Request, max_tokens: int) -> list[int]:
            return [7] * max_tokens

    request = Request("r", [1, 2, 3], SamplingParams(), 0, 50, frozenset(), 0.0)
    request.num_computed_tokens = 2  # decoding
    for seconds, explored in ((0.02, 0), (0.0045, 3)):
        Guesser.seconds_per_guess = seconds
        speculator = Speculator(SpeculativeConfig(method="ngram"), Guesser(), 100)
        speculator.cost = SpeculationCost(prior_acceptance=0.05)  # (rejected: turned down)
        for tokens in (1, 5):
            speculator.cost.observe_step(tokens, 0.006 + 0.0001 * tokens)
        wanted = sum(speculator.wants_proposals([request]) for _ in range(200))
        assert wanted == explored  # every 64th step, only while a kept guess could pay
