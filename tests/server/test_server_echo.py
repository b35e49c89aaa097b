"""/v1/completions with `echo`: the prompt before the completion and, with `logprobs`, the
prompt tokens' logprobs before the completion's (the first null), streaming or not; `echo`
with max_tokens 0 answers the prompt alone. Through the official `openai` client."""

from __future__ import annotations

import pytest
from server_helpers import MODEL, wait_idle

from jaxcb import SamplingParams

PROMPT = "The quick brown fox jumps over"


def _offline(reference_llm, prompt, k: int | None, max_tokens: int = 5):
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        logprobs=k,
        prompt_logprobs=k,
    )
    return reference_llm.generate([prompt], params, use_tqdm=False)[0]


def _joined_stream(stream) -> tuple[list[str], dict, str | None]:
    """The texts of the chunks, the logprobs lists concatenated, the finish reason."""
    texts, logprobs, finish = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts.append(choice.text)
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    logprobs.setdefault(name, []).extend(getattr(choice.logprobs, name))
    return texts, logprobs, finish


def test_echo_with_logprobs_equals_the_engine_s_prompt_logprobs(openai_client, reference_llm):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2)
    out = openai_client.completions.create(**args, extra_body={"ignore_eos": True})
    want = _offline(reference_llm, PROMPT, 2)
    ids = want.prompt_token_ids
    (choice,) = out.choices
    assert choice.text == PROMPT + want.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_lps = [want.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(prompt_lps, abs=1e-5)
    assert lp.token_logprobs[len(ids) :] == pytest.approx(want.outputs[0].logprobs, abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1 : len(ids)])  # token + top-2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(ids)] == sum(len(t) for t in lp.tokens[: len(ids)])
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 5

    texts, logprobs, finish = _joined_stream(
        openai_client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
    )
    assert texts[0].startswith(PROMPT)  # the prompt comes in the first chunk
    assert "".join(texts) == choice.text and finish == choice.finish_reason
    assert logprobs["tokens"] == lp.tokens and logprobs["text_offset"] == lp.text_offset
    assert logprobs["token_logprobs"] == lp.token_logprobs


def test_echo_of_token_ids_without_logprobs(openai_client, reference_llm):
    ids = [5, 6, 7, 8]
    out = openai_client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True
    )
    (choice,) = out.choices
    assert choice.logprobs is None
    want = _offline(reference_llm, ids, None, max_tokens=3)
    assert choice.text == reference_llm.tokenizer.decode(ids) + want.text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_is_the_prompt_alone(openai_client, server, stream):
    args = dict(model=MODEL, prompt=[PROMPT, "hi"], max_tokens=0, echo=True, logprobs=0)
    if stream:
        chunks = list(
            openai_client.completions.create(
                **args, stream=True, stream_options={"include_usage": True}
            )
        )
        choices = [c for chunk in chunks for c in chunk.choices]
        assert sorted(c.index for c in choices) == [0, 1]  # one chunk per choice
        usage = chunks[-1].usage
    else:
        out = openai_client.completions.create(**args)
        choices, usage = out.choices, out.usage
    choices = sorted(choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [PROMPT, "hi"]
    assert [c.finish_reason for c in choices] == ["length", "length"]
    assert usage.completion_tokens == 0
    lp = choices[0].logprobs
    assert len(lp.tokens) == usage.prompt_tokens - 3  # "hi" is 3 tokens with BOS
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])  # logprobs 0: the token alone
    wait_idle(server.url)
