"""The official `openai` client against the server: completions and chat, streaming or not."""

from __future__ import annotations

import pytest
from server_helpers import MODEL, request, wait_idle

from jaxcb import SamplingParams

PROMPT = "The quick brown fox jumps over"


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str | None], object]:
    """Concatenated text and finish reason per choice index, and the usage chunk's usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice, "text", None)
            if piece is None:  # chat
                piece = choice.delta.content or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    return texts, finish, usage


def test_models_lists_the_served_model(openai_client, server):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, _ = request("GET", server.url + "/health")
    assert status == 200


def test_completion_matches_offline_generate(openai_client, reference_llm):
    out = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (want,) = reference_llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    assert out.object == "text_completion" and out.model == MODEL
    (choice,) = out.choices
    assert choice.token_ids == want.token_ids
    assert choice.text == want.text
    assert choice.finish_reason == want.finish_reason
    prompt_len = len(want.prompt_token_ids)
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.total_tokens == prompt_len + len(want.token_ids)


def test_completion_stream_equals_non_stream(openai_client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    full = openai_client.completions.create(**args)
    stream = openai_client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, usage = _stream_text(stream)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: full.choices[0].finish_reason}
    assert usage is not None and usage == full.usage


def test_chat_stream_equals_non_stream(openai_client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    args = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    full = openai_client.chat.completions.create(**args)
    assert full.object == "chat.completion"
    (choice,) = full.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1

    chunks = list(
        openai_client.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, finish, usage = _stream_text(iter(chunks))
    assert texts == {0: choice.message.content}
    assert finish == {0: choice.finish_reason}
    assert usage == full.usage


def test_chat_uses_the_chat_template(openai_client, reference_llm):
    messages = [{"role": "user", "content": "hi"}]
    out = openai_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    tokenizer = reference_llm.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    (want,) = reference_llm.generate(
        [ids], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].token_ids == want.token_ids
    assert out.choices[0].message.content == want.text


@pytest.mark.parametrize("stream", [False, True])
def test_n2_returns_two_choices(openai_client, stream):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    if stream:
        texts, finish, _ = _stream_text(openai_client.completions.create(**args, stream=True))
        assert sorted(texts) == [0, 1]
        assert sorted(finish) == [0, 1] and all(finish.values())
    else:
        out = openai_client.completions.create(**args, extra_body={"return_token_ids": True})
        assert [c.index for c in out.choices] == [0, 1]
        assert all(c.finish_reason in ("stop", "length") for c in out.choices)
        assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)


def test_n2_chat_and_seeded_sampling_is_reproducible(openai_client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        seed=1234,
        n=2,
        extra_body={"return_token_ids": True, "top_k": 50, "min_p": 0.01},
    )
    first = openai_client.chat.completions.create(**args)
    second = openai_client.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in second.choices]
    assert first.choices[0].token_ids != first.choices[1].token_ids  # samples differ


@pytest.mark.parametrize("prompts", [["one", "two two", "three three three"], [[5, 6, 7], [8, 9]]])
def test_batch_of_prompts(openai_client, reference_llm, prompts):
    out = openai_client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=5,
        temperature=0,
        n=2,
        extra_body={"return_token_ids": True},
    )
    want = reference_llm.generate(
        prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False
    )
    assert [c.index for c in out.choices] == list(range(2 * len(prompts)))
    for c in out.choices:  # choice index = prompt index * n + sample index
        assert c.token_ids == want[c.index // 2].token_ids
    assert out.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


def test_stop_strings(openai_client, reference_llm):
    (free,) = reference_llm.generate(
        PROMPT, SamplingParams(max_tokens=30, temperature=0), use_tqdm=False
    )
    text = free.text
    # a stop string from the middle of the greedy text: two printable ASCII characters
    starts = [i for i in range(3, len(text) - 1) if text[i : i + 2].isascii()]
    starts = [i for i in starts if text[i : i + 2].isprintable()]
    assert starts, f"no usable stop string in {text!r}"
    stop = text[starts[0] : starts[0] + 2]
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "never"])
    out = openai_client.completions.create(**args)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    texts, finish, _ = _stream_text(openai_client.completions.create(**args, stream=True))
    assert texts == {0: out.choices[0].text}
    assert finish == {0: "stop"}


def test_logprobs(openai_client):
    out = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)

    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 2 for item in content)
    # greedy: the chosen token is the most likely one
    assert all(item.logprob == pytest.approx(item.top_logprobs[0].logprob) for item in content)


def test_ignore_eos_runs_to_max_tokens(openai_client, server):
    out = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 40
    assert out.choices[0].finish_reason == "length"
    wait_idle(server.url)
