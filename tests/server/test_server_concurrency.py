"""64 concurrent streams with mixed lengths: each gets exactly the offline engine's tokens."""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import MODEL, metric, scrape, wait_idle

from jaxcb import SamplingParams

NUM_REQUESTS = 64


def _prompt(i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    return " ".join(words[(i * 7 + k) % len(words)] for k in range(1 + (i * 5) % 17))


def _max_tokens(i: int) -> int:
    return 2 + (i * 13) % 37


async def _stream_all(url: str) -> list[tuple[str, list[int], str]]:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> tuple[str, list[int], str]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=_prompt(i),
            max_tokens=_max_tokens(i),
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        text, ids, finish = "", [], None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                ids += choice.token_ids
                finish = choice.finish_reason or finish
        return text, ids, finish

    try:
        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    finally:
        await client.close()


def test_64_concurrent_streams_match_offline_generate(server, reference_llm):
    before = scrape(server.url)
    results = asyncio.run(_stream_all(server.url))

    expected = reference_llm.generate(
        [_prompt(i) for i in range(NUM_REQUESTS)],
        [SamplingParams(max_tokens=_max_tokens(i), temperature=0) for i in range(NUM_REQUESTS)],
        use_tqdm=False,
    )
    for i, ((text, ids, finish), want) in enumerate(zip(results, expected, strict=True)):
        assert ids == want.token_ids, f"request {i}: token ids differ"
        assert text == want.text, f"request {i}: text differs"
        assert finish == want.finish_reason, f"request {i}"
    assert len({tuple(ids) for _, ids, _ in results}) > NUM_REQUESTS // 2  # outputs are diverse

    after = wait_idle(server.url)  # every page back in the pool
    assert metric(after, "jaxcb:kv_cache_usage_perc") == 0
    generated = sum(len(ids) for _, ids, _ in results)
    grew = metric(after, "jaxcb:generation_tokens_total") - metric(
        before, "jaxcb:generation_tokens_total"
    )
    assert grew == generated
    finished = metric(after, "jaxcb:request_success_total") - metric(
        before, "jaxcb:request_success_total"
    )
    assert finished == NUM_REQUESTS
