"""Structured outputs on the real model (SmolLM2-135M-Instruct), offline: the suite of JSON
schemas, regexes and choices (jaxcb/bench/structured_suite.py) always satisfied; unconstrained
requests in the same batch unchanged; preemption, prefix-cache hits, async scheduling and n > 1
keep constrained outputs valid and identical; bad constraints are one-line errors."""

from __future__ import annotations

import json

import pytest

from jaxcb import LLM, SamplingParams
from jaxcb.bench.structured_suite import MAX_TOKENS, cases, chat

ENGINE = dict(
    dtype="bfloat16",
    max_num_seqs=32,
    max_num_batched_tokens=256,
    token_buckets=[32, 256],
    max_model_len=512,
    page_size=16,
)
SUITE = cases()


def prompts(llm: LLM, items) -> list[str]:
    return [
        llm.tokenizer.apply_chat_template(
            chat(c.prompt), tokenize=False, add_generation_prompt=True
        )
        for c in items
    ]


def constrained(case, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=case.structured_outputs, **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, **ENGINE)


@pytest.fixture(scope="module")
def suite_outputs(llm):
    outs = llm.generate(prompts(llm, SUITE), [constrained(c) for c in SUITE], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_suite_outputs_satisfy_their_constraints(suite_outputs):
    assert len(SUITE) >= 30 and sum(c.name.startswith("json:") for c in SUITE) >= 20
    problems = {
        c.name: (o.text, c.check(o.text), o.finish_reason)
        for c, o in zip(SUITE, suite_outputs, strict=True)
        if c.check(o.text) is not None or o.finish_reason != "stop"
    }
    assert not problems


def test_unconstrained_rows_keep_their_tokens(llm, suite_outputs):
    """A batch of constrained and unconstrained requests gives the unconstrained ones
    exactly the tokens they get alone (the mask touches constrained rows only)."""
    free = prompts(llm, SUITE[:4])
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = llm.generate(free, plain, use_tqdm=False)
    mixed_cases = SUITE[-6:]
    mixed = llm.generate(
        free + prompts(llm, mixed_cases),
        [plain] * len(free) + [constrained(c) for c in mixed_cases],
        use_tqdm=False,
    )
    for a, m in zip(alone, mixed, strict=False):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    for c, m in zip(mixed_cases, mixed[len(free) :], strict=True):
        assert c.check(m.outputs[0].text) is None


def test_preemption_prefix_cache_and_async_keep_outputs():
    """A pool small enough to preempt, with the prefix cache and async scheduling on: the
    same constrained tokens as a roomy engine's for the same requests, twice (the second
    time from cache). In float32: a preempted request is prefilled again in other chunks, and
    in bfloat16 that can flip a near-tie (docs/architecture.md, "Sampling determinism"; one
    of these requests has two tokens 0.0035 nats apart at its eighth token)."""
    picked = SUITE[::3]
    engine = {**ENGINE, "dtype": "float32"}
    roomy = LLM(None, **engine)
    outs = roomy.generate(prompts(roomy, picked), [constrained(c) for c in picked], use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]
    small = LLM(
        None,
        **{**engine, "num_pages": 20, "max_num_seqs": 16, "max_model_len": 256},
        enable_prefix_caching=True,
        async_scheduling=True,
    )
    for _ in range(2):
        outs = small.generate(
            prompts(small, picked), [constrained(c) for c in picked], use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in outs] == want
    stats = small.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0
    assert stats["grammars_compiled"] == len(picked) and stats["grammar_cache_hits"] >= len(picked)


def test_sampled_n_and_length(llm):
    """n > 1 with sampling: every sample valid; a grammar unfinished at max_tokens ends with
    finish_reason "length"."""
    case = next(c for c in SUITE if c.name == "json:multi_type")
    out = llm.generate(
        prompts(llm, [case]), constrained(case, n=3, temperature=0.8, seed=1), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    for sample in out.outputs:
        assert case.check(sample.text) is None and sample.finish_reason == "stop"
    short = llm.generate(
        prompts(llm, [case]),
        SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=case.structured_outputs),
        use_tqdm=False,
    )[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 4


@pytest.mark.parametrize(
    ("so", "match"),
    [
        ({"json": {"type": "integer", "minimum": "x"}}, "invalid structured_outputs.json"),
        ({"json": "{not json"}, "invalid structured_outputs.json"),
        ({"regex": "([a-z]"}, "invalid structured_outputs.regex"),
        ({"grammar": "start: foo"}, "invalid structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice must be"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"jsn": {}}, "unknown fields"),
    ],
)
def test_bad_constraints_are_one_line_errors(llm, so, match):
    with pytest.raises(ValueError, match=match) as err:
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert "\n" not in str(err.value)
    ok = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2  # the engine keeps serving


def test_json_object_and_compact_whitespace(llm):
    out = llm.generate(
        prompts(llm, SUITE[:1]),
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            structured_outputs={
                "json": SUITE[0].structured_outputs["json"],
                "disable_any_whitespace": True,
            },
        ),
        use_tqdm=False,
    )[0].outputs[0]
    value = json.loads(out.text)
    assert json.dumps(value, separators=(",", ":")) == out.text  # no free whitespace


def test_stop_strings_logprobs_aborts_and_no_recompile(llm):
    """Constrained requests with a stop string (which ends them mid-grammar), with logprobs,
    and aborted mid-output: each ends as asked, frees its pages, and no step is traced anew."""
    from jaxcb.runtime import step as step_module

    traces = step_module.TRACE_COUNT[0]
    only = {"regex": "alpha beta gamma"}  # one possible output
    stopped, logged = llm.generate(
        ["Say it.", "Say it."],
        [
            SamplingParams(max_tokens=16, temperature=0.0, stop=[" beta"], structured_outputs=only),
            SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, structured_outputs=only),
        ],
        use_tqdm=False,
    )
    out = stopped.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("alpha", "stop", " beta")
    out = logged.outputs[0]
    assert out.text == "alpha beta gamma" and out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    assert all(len(top) >= 2 for top in out.top_logprobs)

    engine = llm.engine
    so = SUITE[0].structured_outputs
    engine.add_request(
        "cut",
        "Describe a person.",
        SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=so),
    )
    engine.step()
    engine.step()
    assert engine.abort_request("cut").outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and llm.stats()["kv_pages_used"] == 0
    again = llm.generate(["Describe a person."], constrained(SUITE[0]), use_tqdm=False)[0]
    assert SUITE[0].check(again.outputs[0].text) is None
    assert step_module.TRACE_COUNT[0] == traces, "a constrained step was compiled anew"
