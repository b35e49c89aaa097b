"""/metrics parses with prometheus-client's parser, and its counters move as they should."""

from __future__ import annotations

import asyncio
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, metric, request, wait_idle

from jaxcb import SamplingParams

EXPECTED = {
    "jaxcb:num_requests_running": "gauge",
    "jaxcb:num_requests_waiting": "gauge",
    "jaxcb:kv_cache_usage_perc": "gauge",
    "jaxcb:padding_fraction": "gauge",
    "jaxcb:time_to_first_token_seconds": "histogram",
    "jaxcb:inter_token_latency_seconds": "histogram",
    "jaxcb:e2e_request_latency_seconds": "histogram",
    "jaxcb:request_queue_time_seconds": "histogram",
    "jaxcb:request_prefill_time_seconds": "histogram",
    "jaxcb:request_decode_time_seconds": "histogram",
    "jaxcb:request_time_per_output_token_seconds": "histogram",
    "jaxcb:step_bucket_tokens": "histogram",
    "jaxcb:prompt_tokens": "counter",
    "jaxcb:generation_tokens": "counter",
    "jaxcb:num_preemptions": "counter",
    "jaxcb:swapped_out_requests": "counter",
    "jaxcb:swapped_in_requests": "counter",
    "jaxcb:swap_fallbacks": "counter",
    "jaxcb:swap_pages_used": "gauge",
    "jaxcb:recomputed_tokens": "counter",
    "jaxcb:admitted_idle_pages": "gauge",
    "jaxcb:predicted_output_len": "gauge",
}


def test_metrics_parse_with_prometheus_client(server):
    status, text = request("GET", server.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in EXPECTED.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, name
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample


def test_startup_heap_is_frozen_out_of_full_collections(server):
    """serve.py freezes what start-up built (jax, transformers, the engine), so a full
    collection while serving does not walk it: the banner says how many objects."""
    frozen = re.search(r"gc: +(\d+) start-up objects frozen", server.log())
    assert frozen is not None, server.tail()
    assert int(frozen.group(1)) > 50_000  # jax and transformers alone hold more


def test_counters_move_as_expected(server):
    before = wait_idle(server.url)
    prompt = list(range(5, 14))  # 9 token ids: a 16-token bucket, 7 rows of it padding
    status, body = request(
        "POST",
        server.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 7, "ignore_eos": True, "temperature": 0},
    )
    assert status == 200, body
    after = wait_idle(server.url)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("jaxcb:prompt_tokens_total") == 9
    assert grew("jaxcb:generation_tokens_total") == 7
    assert grew("jaxcb:request_success_total", finished_reason="length") == 1
    assert grew("jaxcb:time_to_first_token_seconds_count") == 1
    assert grew("jaxcb:e2e_request_latency_seconds_count") == 1
    assert grew("jaxcb:inter_token_latency_seconds_count") == 6
    for phase in ("queue_time", "prefill_time", "decode_time", "time_per_output_token"):
        assert grew(f"jaxcb:request_{phase}_seconds_count") == 1, phase
    # the phases add up to no more than the request's own time (the engine's clock)
    phases = ("queue_time", "prefill_time", "decode_time")
    phases = sum(grew(f"jaxcb:request_{p}_seconds_sum") for p in phases)
    assert 0 < phases <= grew("jaxcb:e2e_request_latency_seconds_sum")
    tpot = grew("jaxcb:request_time_per_output_token_seconds_sum")
    assert tpot == pytest.approx(grew("jaxcb:request_decode_time_seconds_sum") / 6)
    # one prefill step (9 tokens: the 16-token bucket) and six decode steps (the 1-token
    # bucket): on CPU the default buckets are powers of two from 1
    assert grew("jaxcb:step_bucket_tokens_count") == 7
    assert grew("jaxcb:step_bucket_tokens_sum") == 16 + 6 * 1
    assert grew("jaxcb:step_bucket_tokens_bucket", le="16.0") == 7
    assert 0 < metric(after, "jaxcb:padding_fraction") < 1
    assert metric(after, "jaxcb:kv_cache_usage_perc") == 0
    assert metric(after, "jaxcb:num_requests_running") == 0


def test_preemption_is_counted_and_loses_nothing(server, reference_llm):
    """8 long requests need more pages than the pool has (64 x 16 tokens): some are
    preempted and recomputed, and still produce the offline engine's tokens."""
    openai = pytest.importorskip("openai")
    prompts = [f"preempt {i}" for i in range(8)]
    before = wait_idle(server.url)

    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        try:
            outs = await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL,
                        prompt=p,
                        max_tokens=200,
                        temperature=0,
                        extra_body={"ignore_eos": True, "return_token_ids": True},
                    )
                    for p in prompts
                )
            )
        finally:
            await client.close()
        return [o.choices[0].token_ids for o in outs]

    got = asyncio.run(run())
    want = reference_llm.generate(
        prompts, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert got == [w.token_ids for w in want]
    after = wait_idle(server.url)
    preempted = metric(after, "jaxcb:num_preemptions_total") - metric(
        before, "jaxcb:num_preemptions_total"
    )
    assert preempted > 0
    assert metric(after, "jaxcb:kv_cache_usage_perc") == 0
