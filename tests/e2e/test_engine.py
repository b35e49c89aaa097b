"""Engine behaviour end to end on the built-in tiny model: pages, compilation, sampling, errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams
from jaxcb.native import available as native_available
from jaxcb.runtime import step as step_module

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 32, 64],
    max_model_len=256,
    page_size=8,
    num_pages=64,
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**CONFIG)


def prompts(n: int, seed: int, max_len: int = 120) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(1, max_len, size=n)]


def test_page_invariant_every_step_and_pool_full_after_aborts(llm):
    engine = llm.engine
    reqs = [
        (p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in prompts(12, 0)
    ]
    ids = [engine.add_request(None, p, sp) for p, sp in reqs]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request(ids[0])  # running or waiting: both must free everything
            engine.abort_request(ids[-1])
        engine.check_page_invariant()
    assert engine.pool.num_used == 0
    assert engine.pool.num_free == engine.info.num_pages


def test_no_recompilation_after_warmup(llm):
    traces = step_module.TRACE_COUNT[0]
    rng = np.random.default_rng(5)
    for trial in range(3):
        n = int(rng.integers(1, 12))
        ps = prompts(n, seed=trial, max_len=200)
        params = [
            SamplingParams(
                max_tokens=int(rng.integers(1, 20)),
                temperature=float(rng.choice([0.0, 0.8])),
                top_k=int(rng.choice([0, 5])),
                top_p=float(rng.choice([1.0, 0.9])),
                logprobs=int(rng.choice([0, 3])) or None,
                presence_penalty=float(rng.choice([0.0, 0.5])),
                seed=trial,
            )
            for _ in ps
        ]
        llm.generate(ps, params, use_tqdm=False)
    assert step_module.TRACE_COUNT[0] == traces, "the step function was traced again"
    assert set(llm.stats()["bucket_histogram"]) <= {16, 32, 64}


def test_seeded_sampling_independent_of_batch(llm):
    target = prompts(1, seed=42, max_len=50)[0]
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate([target], sp, use_tqdm=False)[0].token_ids
    others = prompts(7, seed=43, max_len=150)
    mixed_params = [
        SamplingParams(max_tokens=int(10 + i), temperature=0.7, seed=i) for i in range(7)
    ]
    batch = llm.generate(
        [*others[:3], target, *others[3:]],
        [*mixed_params[:3], sp, *mixed_params[3:]],
        use_tqdm=False,
    )
    assert batch[3].token_ids == alone
    greedy_batch = llm.generate(
        [target, *others], [sp] + [SamplingParams(max_tokens=5, temperature=0)] * 7, use_tqdm=False
    )
    assert greedy_batch[0].token_ids == alone
    other_seed = llm.generate(
        [target],
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=99),
        use_tqdm=False,
    )
    assert other_seed[0].token_ids != alone


def test_preempted_seeded_request_keeps_its_tokens():
    """Sampling keys depend on (seed, tokens generated), so recompute redraws the same tokens."""
    sp = [SamplingParams(max_tokens=40, temperature=0.9, seed=s, ignore_eos=True) for s in range(8)]
    ps = prompts(8, seed=7, max_len=100)
    roomy = LLM(**{**CONFIG, "num_pages": 256}).generate(ps, sp, use_tqdm=False)
    tight_llm = LLM(**{**CONFIG, "num_pages": 40})
    tight = tight_llm.generate(ps, sp, use_tqdm=False)
    assert tight_llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_generate_api(llm):
    outs = llm.generate(
        ["Hello", "Hi there"],
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(o.finish_reason == "length" and isinstance(o.text, str) for o in outs)
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time
    single = llm.generate(
        "Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert single[0].token_ids == outs[0].token_ids
    ids = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert ids[0].prompt_token_ids == [5, 6, 7]
    two = llm.generate(
        "Hello", SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3), use_tqdm=False
    )[0]
    assert len(two.outputs) == 2 and two.outputs[0].token_ids != two.outputs[1].token_ids
    stats = llm.stats()
    for key in (
        "steps",
        "bucket_histogram",
        "padding_fraction",
        "compile_seconds",
        "kv_pages_peak",
    ):
        assert key in stats


def test_final_only_requests_report_once(llm):
    engine = llm.engine
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    streamed = engine.add_request(None, [5, 6, 7], sp)
    final = engine.add_request(None, [5, 6, 7], sp, final_only=True)
    seen: dict[str, list] = {streamed: [], final: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [len(o.outputs[0].token_ids) for o in seen[streamed]] == [1, 2, 3, 4]
    assert len(seen[final]) == 1 and seen[final][0].finished
    assert seen[final][0].outputs[0].token_ids == seen[streamed][-1].outputs[0].token_ids


def test_stop_conditions(llm):
    base = llm.generate(
        [[10, 11, 12]],
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    tokens = base.token_ids
    stop_tok = tokens[5]
    first = tokens.index(stop_tok)
    out = llm.generate(
        [[10, 11, 12]],
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_tok
    # EOS: make the engine treat the 4th greedy token as EOS by checking ignore_eos semantics
    eos_req = llm.engine.eos_token_ids
    assert 2 in eos_req
    text = base.text
    if len(text) >= 4:
        stop = text[2:4]
        out = llm.generate(
            [[10, 11, 12]],
            SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.text == text[: text.index(stop)]


def test_logprobs(llm):
    out = llm.generate(
        [[10, 11, 12]], SamplingParams(max_tokens=4, temperature=0, logprobs=3), use_tqdm=False
    )[0]
    lp = out.outputs[0].logprobs
    top = out.outputs[0].top_logprobs
    assert len(lp) == len(out.token_ids) == len(top)
    for tok, chosen, tops in zip(out.token_ids, lp, top, strict=True):
        assert chosen <= 0 and len(tops) == 3
        assert max(tops, key=tops.get) == tok  # greedy picks the most likely token
        assert abs(tops[tok] - chosen) < 1e-5


def test_bad_input_is_rejected_and_changes_nothing(llm):
    engine = llm.engine
    free_before = engine.pool.num_free
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len=256"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        llm.generate([[1, 2, 100000]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([[1, 2]], SamplingParams(logprobs=50), use_tqdm=False)
    # a bad prompt among good ones: nothing at all is queued
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [5] * 999], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == free_before
    ok = llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(ok[0].token_ids) >= 1


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match=r"unknown config field 'max_num_seq'.*max_num_seqs"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(max_num_seqs=64, max_num_batched_tokens=32, token_buckets=[32])
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(TINY_MODEL, num_pages=2, page_size=8, max_model_len=256)


def test_bfloat16_model_and_kv_cache_dtypes():
    """bf16 weights run. With the XLA attention path on CPU the KV pages default to float32
    (XLA's CPU bf16 scatter copies the whole pool); the native CPU kernels keep bf16 pages.
    Greedy tokens agree across the three set-ups at first."""
    prompt = [[10, 11, 12, 13]]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    small = {**CONFIG, "max_num_batched_tokens": 16, "token_buckets": [16]}  # one compile
    xla = LLM(dtype="bfloat16", attention="xla", **small)
    assert xla.engine.info.kv_cache_dtype == "float32"
    forced = LLM(dtype="bfloat16", attention="xla", kv_cache_dtype="bfloat16", **small)
    assert forced.engine.info.kv_cache_dtype == "bfloat16"
    outs = [xla.generate(prompt, sp, use_tqdm=False)[0].token_ids]
    outs.append(forced.generate(prompt, sp, use_tqdm=False)[0].token_ids)
    if native_available():
        native = LLM(dtype="bfloat16", attention="native", **small)
        assert native.engine.info.kv_cache_dtype == "bfloat16"
        outs.append(native.generate(prompt, sp, use_tqdm=False)[0].token_ids)
    assert all(len(o) == 12 for o in outs)
    assert all(o[:3] == outs[0][:3] for o in outs)


def test_penalties_change_greedy_output_and_survive_preemption():
    prompt = [[7, 8, 9, 7, 8, 9, 7, 8, 9]]
    n = 64
    plain = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    rep = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repetition_penalty=50.0)
    freq = SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
    )
    llm = LLM(**{**CONFIG, "token_buckets": [16, 64]})
    base, with_rep, with_freq = (
        llm.generate(prompt, sp, use_tqdm=False)[0].token_ids for sp in (plain, rep, freq)
    )
    assert len(set(base)) < n, "the plain output must repeat itself for this test to mean much"
    # a huge repetition penalty makes every seen token (prompt or output) lose to an unseen one
    assert len(set(with_rep)) == n and not set(with_rep) & set(prompt[0])
    assert with_freq != base
    # the same requests in a crowded, preempting engine give the same tokens
    tight = LLM(**{**CONFIG, "token_buckets": [16, 64], "num_pages": 33})
    crowd = prompts(6, seed=9, max_len=120)
    outs = tight.generate([*crowd, prompt[0], prompt[0]], [plain] * 6 + [rep, freq], use_tqdm=False)
    assert tight.stats()["preemptions"] > 0
    assert outs[-2].token_ids == with_rep and outs[-1].token_ids == with_freq
