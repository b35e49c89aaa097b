"""`scripts/serve.py` with no --model serves the real default, SmolLM2-135M-Instruct, and
answers a factual chat question through the official openai client, streaming and not."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

NAME = "SmolLM2-135M-Instruct"  # the default model's served name
# Sized for the test: two buckets to compile, room for the chat template's system prompt.
ARGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--token-buckets", "16", "64"]
ARGS += ["--max-model-len", "512"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(start_server):
    with (
        start_server(ARGS) as server,
        openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as c,
    ):
        yield c


def test_the_default_model_is_served(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_a_factual_question_is_answered(client):
    out = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=32, temperature=0
    )
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # ended by <|im_end|>, not the length cap


def test_a_factual_question_is_answered_streaming(client):
    stream = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=32, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "Paris" in "".join(pieces), pieces
    assert len([p for p in pieces if p]) > 1  # streamed, not one block
