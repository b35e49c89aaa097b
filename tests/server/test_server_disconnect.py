"""A client that goes away aborts its request at once; its pages are freed; others carry on."""

from __future__ import annotations

import threading
import time

from server_helpers import (
    MODEL,
    metric,
    open_raw_request,
    read_events,
    wait_for_metrics,
    wait_idle,
)

from jaxcb import SamplingParams

LONG = {"max_tokens": 500, "ignore_eos": True, "temperature": 0}  # seconds of work


def _aborted(samples: dict) -> float:
    return metric(samples, "jaxcb:request_success_total", finished_reason="abort")


def test_stream_disconnect_aborts_and_others_are_unaffected(server, openai_client, reference_llm):
    before = wait_idle(server.url)
    victim = open_raw_request(
        server, "/v1/completions", {"prompt": "victim", "stream": True, **LONG}
    )
    assert read_events(victim, 3).startswith(b"HTTP/1.1 200")  # it is generating

    bystander: dict = {}

    def run_bystander() -> None:
        stream = openai_client.completions.create(
            model=MODEL,
            prompt="bystander",
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        bystander["ids"] = [t for chunk in stream for c in chunk.choices for t in c.token_ids]

    thread = threading.Thread(target=run_bystander)
    thread.start()
    time.sleep(0.05)
    victim.close()
    t0 = time.monotonic()
    wait_for_metrics(server.url, lambda s: _aborted(s) == _aborted(before) + 1)
    abort_seconds = time.monotonic() - t0
    thread.join(60)

    (want,) = reference_llm.generate(
        "bystander", SamplingParams(max_tokens=60, temperature=0), use_tqdm=False
    )
    assert bystander["ids"] == want.token_ids
    after = wait_idle(server.url)
    assert metric(after, "jaxcb:kv_cache_usage_perc") == 0
    assert abort_seconds < 5
    # the victim stopped early: far fewer than its 500 tokens were generated
    generated = metric(after, "jaxcb:generation_tokens_total") - metric(
        before, "jaxcb:generation_tokens_total"
    )
    assert generated < 60 + 500


def test_non_streaming_disconnect_aborts(server):
    before = wait_idle(server.url)
    victim = open_raw_request(server, "/v1/completions", {"prompt": "victim", **LONG})
    wait_for_metrics(server.url, lambda s: metric(s, "jaxcb:num_requests_running") == 1)
    victim.close()
    wait_for_metrics(server.url, lambda s: _aborted(s) == _aborted(before) + 1)
    after = wait_idle(server.url)
    assert metric(after, "jaxcb:kv_cache_usage_perc") == 0
