"""The serving benchmark's metrics on synthetic timestamps, and its client against a fake
server.

The fake server (asyncio, standard library) streams server-sent events with chosen delays in
a chunked body, so the client's timing, parsing and the metrics are checked end to end with
no engine, in well under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import numpy as np
import pytest

from jaxcb.bench.commands import command_parser, load
from jaxcb.bench.serving_client import (
    Endpoint,
    SampleRequest,
    arrival_offsets,
    random_requests,
    run_requests,
    sharegpt_requests,
    sse_events,
)
from jaxcb.bench.serving_metrics import (
    RequestResult,
    calculate_metrics,
    format_report,
    parse_goodput,
    peak_concurrency,
)


def synthetic() -> list[RequestResult]:
    # A: sent at 0, chunks at 0.100, 0.120, 0.140, 0.160 (4 tokens)
    # B: sent at 0.5, chunks at 0.8, 0.9 (2 tokens)
    # C: sent at 1.0, one chunk at 1.05 (1 token)
    # D: failed
    return [
        RequestResult(True, 10, 4, ttft=0.1, itl=[0.02, 0.02, 0.02], latency=0.16, start_time=0.0),
        RequestResult(True, 20, 2, ttft=0.3, itl=[0.1], latency=0.4, start_time=0.5),
        RequestResult(True, 30, 1, ttft=0.05, itl=[], latency=0.05, start_time=1.0),
        RequestResult(False, 40, error="boom"),
    ]


def test_known_answers_on_synthetic_timestamps():
    m = calculate_metrics(synthetic(), duration_s=2.0, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 7)  # failed left out
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    # TTFT over the successful requests: 100, 300, 50 ms
    assert m["mean_ttft_ms"] == pytest.approx(150)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99))
    # TPOT: A (160 - 100) / 3 = 20 ms, B (400 - 300) / 1 = 100 ms; C has one token: left out
    assert m["mean_tpot_ms"] == pytest.approx(60)
    assert m["median_tpot_ms"] == pytest.approx(60)
    # ITL pooled: 20, 20, 20, 100 ms
    assert m["mean_itl_ms"] == pytest.approx(40)
    assert m["median_itl_ms"] == pytest.approx(20)
    assert m["p50_itl_ms"] == pytest.approx(20)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([20, 20, 20, 100], 99))
    assert m["mean_e2el_ms"] == pytest.approx((160 + 400 + 50) / 3)
    # chunks arrive in second 0 (A's 4) and second 0 again (B at 0.8, 0.9) and 1 (C)
    assert m["max_output_tokens_per_s"] == 6
    assert m["max_concurrent_requests"] == 1  # A ends at 0.16 < 0.5; B ends at 0.9 < 1.0
    assert "request_goodput" not in m


def test_goodput_counts_requests_meeting_every_slo():
    results = synthetic()
    # ttft <= 120 ms: A (100) and C (50); tpot <= 50 ms: A (20), C (one token: 0)
    m = calculate_metrics(results, 2.0, goodput=parse_goodput(["ttft:120", "tpot:50"]))
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    m = calculate_metrics(results, 2.0, goodput=parse_goodput(["e2el:300"]))
    assert m["request_goodput"] == pytest.approx(2 / 2.0)  # A (160) and C (50)
    m = calculate_metrics(results, 2.0, goodput={"tpot": 10.0})
    assert m["request_goodput"] == pytest.approx(1 / 2.0)  # only C
    for bad in (["ttft"], ["latency:5"], ["ttft:-1"], ["tpot:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peak_concurrency_overlaps():
    rs = [
        RequestResult(True, 1, 1, latency=1.0, start_time=0.0),
        RequestResult(True, 1, 1, latency=1.0, start_time=0.5),
        RequestResult(True, 1, 1, latency=0.2, start_time=0.6),
        RequestResult(True, 1, 1, latency=1.0, start_time=1.0),  # starts as the first ends
    ]
    assert peak_concurrency(rs) == 3


def test_report_uses_vllm_labels():
    m = calculate_metrics(synthetic(), 2.0, goodput={"ttft": 120.0})
    text = format_report(m, request_rate=4.0, burstiness=1.0, max_concurrency=8)
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Maximum request concurrency:",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
        "Median E2EL (ms):",
        "Time per Output Token (excl. 1st token)",
    ):
        assert label in text, label
    assert text.splitlines()[0] == "{:=^50}".format(" Serving Benchmark Result ")
    line = next(x for x in text.splitlines() if x.startswith("Mean TTFT (ms):"))
    assert line.split()[-1] == "150.00"


def test_arrivals_and_datasets():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4000, 20.0, 1.0, 0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20, rel=0.1)  # exponential: std = mean
    bursty = np.diff(arrival_offsets(4000, 20.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.1) and bursty.std() > 1.5 * gaps.std()
    assert arrival_offsets(5, 3.0, 1.0, 7) == arrival_offsets(5, 3.0, 1.0, 7)

    reqs = random_requests(
        200, input_len=100, output_len=20, range_ratio=0.5, vocab_size=320, seed=0
    )
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.expected_output_len <= 30 for r in reqs)
    assert all(3 <= t < 320 for r in reqs for t in r.prompt)
    assert (
        reqs[0].prompt
        == random_requests(
            200, input_len=100, output_len=20, range_ratio=0.5, vocab_size=320, seed=0
        )[0].prompt
    )
    with pytest.raises(ValueError):
        random_requests(1, input_len=10, output_len=1, range_ratio=1.0, vocab_size=320, seed=0)


def test_sharegpt_filtering(tmp_path):
    def conv(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}

    data = [
        conv("a b c d e", "f g h i"),  # 5 prompt, 4 output: kept
        conv("a b", "c d e f"),  # prompt too short
        conv("a b c d", "e f"),  # output too short
        conv(" ".join(["w"] * 1100), "x y z w"),  # prompt too long
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        conv("p q r s t u", "v w x y z"),  # kept
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))

    def tokenizer(text: str) -> dict:
        return {"input_ids": text.split()}

    reqs = sharegpt_requests(str(path), 2, tokenizer=tokenizer, seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(5, 4), (6, 5)]
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(str(path), 3, tokenizer=tokenizer, seed=0)


def test_sse_parser_handles_split_lines():
    pending = [b""]
    assert sse_events(pending, b'data: {"a"') == []
    assert sse_events(pending, b": 1}\n\ndata: [DO") == ['{"a": 1}']
    assert sse_events(pending, b"NE]\r\n\r\n") == ["[DONE]"]


# ---- the client against a fake server -----------------------------------------------------


async def fake_server(delays: list[float], texts: list[str]):
    """Serves every POST with a chunked SSE stream: texts[i] after delays[i] seconds, then a
    usage chunk and [DONE]. Returns (server, port, bodies received)."""
    bodies = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = next(int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length"))
        bodies.append(json.loads(await reader.readexactly(length)))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

        def chunk(payload: str) -> bytes:
            data = f"data: {payload}\n\n".encode()
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        for delay, text in zip(delays, texts, strict=True):
            await asyncio.sleep(delay)
            writer.write(chunk(json.dumps({"choices": [{"index": 0, "text": text}]})))
            await writer.drain()
        writer.write(chunk(json.dumps({"choices": [], "usage": {"completion_tokens": 5}})))
        writer.write(chunk("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], bodies


def test_client_times_a_streamed_completion():
    async def run():
        # an empty-text chunk is not content: TTFT is the first non-empty one
        server, port, bodies = await fake_server(
            [0.05, 0.0, 0.03, 0.06, 0.0], ["", "a", "b", "c", "d"]
        )
        async with server:
            endpoint = Endpoint(f"http://127.0.0.1:{port}/v1/completions", "m", ignore_eos=True)
            requests = [SampleRequest([5, 6, 7], 3, 5), SampleRequest("hi", 1, 5)]
            results, duration = await run_requests(endpoint, requests, [0.0, 0.1])
        return results, duration, bodies

    results, duration, bodies = asyncio.run(run())
    assert all(r.success for r in results), [r.error for r in results]
    r = results[0]
    assert r.output_len == 5 and r.generated_text == "abcd" and len(r.itl) == 3
    assert 0.04 <= r.ttft < 0.25 and 0.02 <= r.itl[0] < 0.2 and 0.05 <= r.itl[1] < 0.25
    assert r.itl[2] < 0.02  # sent right after the previous chunk
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert results[1].start_time >= 0.1 and duration >= 0.1 + results[1].latency
    sent = sorted(bodies, key=lambda b: isinstance(b["prompt"], str))
    assert sent[0]["prompt"] == [5, 6, 7] and sent[1]["prompt"] == "hi"
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 5 for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)


def test_client_reports_http_errors():
    async def run():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"error": {"message": "bad model"}}'
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            endpoint = Endpoint(f"http://127.0.0.1:{port}/v1/completions", "m")
            return await run_requests(endpoint, [SampleRequest([1], 1, 2)], [0.0])

    (result,), _ = asyncio.run(run())
    assert not result.success and "404" in result.error and "bad model" in result.error


def parse_serving_flags(argv: list[str]) -> argparse.Namespace:
    """The serving benchmark's flags as the entry point parses and checks them."""
    serving = load("serving")
    parser = command_parser("serving", serving)
    args = parser.parse_args(argv)
    serving.check_args(parser, args)
    return args


def test_serving_flags():
    args = parse_serving_flags(
        ["--port", "9", "--goodput", "ttft:500", "tpot:50", "--metric-percentiles", "50,99"]
    )
    assert args.base_url == "http://127.0.0.1:9" and args.goodput_slos == {"ttft": 500, "tpot": 50}
    assert args.percentiles == [50.0, 99.0] and args.request_rate == math.inf
    for bad in (["--goodput", "ttft"], ["--dataset-name", "sharegpt"], ["--num-prompts", "0"]):
        with pytest.raises(SystemExit):
            parse_serving_flags(bad)


def test_vllm_client_gets_the_same_run_on_its_command_line(tmp_path):
    """--vllm-client: `vllm bench serve`'s own flags for the same run (its datasets only)."""
    from jaxcb.bench.commands.serving import vllm_client_argv

    python = tmp_path / "python"
    python.write_text("")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    flags = ["--vllm-client", str(python), "--tokenizer", str(tokenizer), "--port", "9"]
    run = ["--random-input-len", "512", "--request-rate", "1.5", "--ignore-eos"]
    args = parse_serving_flags([*flags, *run, "--goodput", "ttft:500", "--num-prompts", "64"])
    argv = vllm_client_argv(args, "m", tmp_path / "out" / "r.json")
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--backend"] == "openai" and pairs["--base-url"] == "http://127.0.0.1:9"
    assert pairs["--model"] == "m" and pairs["--tokenizer"] == str(tokenizer)
    assert (pairs["--random-input-len"], pairs["--request-rate"]) == ("512", "1.5")
    assert "--ignore-eos" in argv and argv[argv.index("--goodput") + 1] == "ttft:500"
    assert argv[argv.index("--result-dir") + 1] == str(tmp_path / "out")
    for bad in (["--dataset-name", "chat"], ["--vocab-size", "100"]):
        with pytest.raises(SystemExit):
            parse_serving_flags([*flags, *bad])
    with pytest.raises(SystemExit):  # no tokenizer: vLLM's client tokenizes
        parse_serving_flags(["--vllm-client", str(python)])
