"""The client side of `python -m jaxcb.bench serving`: request datasets, arrival times, and a
small asyncio HTTP/1.1 client that streams an OpenAI-compatible completion and timestamps it.

It talks to any OpenAI-compatible server (jaxcb, `vllm serve`, TGI) with the standard library
alone: one connection per request, `"stream": true` with `stream_options.include_usage`,
server-sent events read as they arrive (chunked or plain bodies). Datasets follow
`vllm bench serve`: `random` (uniform lengths around --random-input-len/--random-output-len
within --random-range-ratio; token ids sent as the prompt, so lengths are exact whatever the
tokenizer) and `sharegpt` (the first human/gpt turns of a ShareGPT JSON file, shuffled with
the seed, keeping prompts of 4..1024 tokens whose prompt + output is at most 2048, as vLLM
filters them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from jaxcb.bench.serving_metrics import RequestResult

# ---- requests ---------------------------------------------------------------------------


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int
    expected_output_len: int


def random_requests(
    num_prompts: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    prefix_len: int = 0,
    first_token_id: int = 3,
    num_prefixes: int = 1,
) -> list[SampleRequest]:
    """Lengths uniform in [len * (1 - r), len * (1 + r)] (at least 1), token ids uniform in
    [first_token_id, vocab_size); an optional common prefix of `prefix_len` ids first, or
    one of `num_prefixes` such prefixes, drawn per request (what prefix routing is about)."""
    if num_prefixes < 1:
        raise ValueError(f"--random-num-prefixes must be >= 1, got {num_prefixes}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if vocab_size <= first_token_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no token ids >= {first_token_id}")
    rng = np.random.default_rng(seed)
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lo_out, hi_out = (
        max(1, int(output_len * (1 - range_ratio))),
        int(output_len * (1 + range_ratio)),
    )
    prefix = rng.integers(first_token_id, vocab_size, size=prefix_len).tolist()
    # more prefixes and each request's pick come from their own generator: with one prefix
    # the requests are the same as before there was a choice
    group_rng = np.random.default_rng([seed, 1])
    prefixes = [prefix] + [
        group_rng.integers(first_token_id, vocab_size, size=prefix_len).tolist()
        for _ in range(num_prefixes - 1)
    ]
    out = []
    for _ in range(num_prompts):
        n = int(rng.integers(lo_in, max(lo_in, hi_in) + 1))
        m = int(rng.integers(lo_out, max(lo_out, hi_out) + 1))
        prefix = prefixes[int(group_rng.integers(num_prefixes))] if num_prefixes > 1 else prefix
        ids = prefix + rng.integers(first_token_id, vocab_size, size=n).tolist()
        out.append(SampleRequest(ids, len(ids), m))
    return out


def sharegpt_requests(
    path: str,
    num_prompts: int,
    *,
    tokenizer: Any,
    seed: int,
    output_len: int | None = None,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """The first two turns of each ShareGPT conversation as (prompt, reference completion),
    shuffled with `seed`; pairs whose lengths fall outside vLLM's bounds are skipped. The
    output length is the reference completion's token count unless `output_len` is given."""
    with open(path) as f:
        data = json.load(f)
    pairs = [
        (d["conversations"][0]["value"], d["conversations"][1]["value"])
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        prompt_len = len(tokenizer(prompt)["input_ids"])
        n_out = output_len or len(tokenizer(completion)["input_ids"])
        too_short = prompt_len < min_len or (output_len is None and n_out < min_len)
        if too_short or prompt_len > max_prompt_len or prompt_len + n_out > max_total_len:
            continue
        out.append(SampleRequest(prompt, prompt_len, n_out))
    if len(out) < num_prompts:
        raise ValueError(f"{path} has only {len(out)} usable conversations, {num_prompts} asked")
    return out


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start): Gamma inter-arrivals of shape `burstiness` and
    mean 1 / request_rate (burstiness 1 = Poisson); all at 0 for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if np.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


# ---- HTTP -------------------------------------------------------------------------------


class HTTPError(RuntimeError):
    pass


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise HTTPError(f"not an HTTP response: {status_line[:100]!r}")
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, by Content-Length, or to the end."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF after the chunk
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                return
            left -= len(data)
            yield data
    else:
        while data := await reader.read(65536):
            yield data


async def post_stream(
    url: str, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[bytes]:
    """POST JSON to `url` and yield the response body's bytes as they arrive; HTTPError with
    the body for a status other than 200."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise HTTPError(f"only http:// URLs are supported, got {url!r}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(payload).encode()
    head = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status, response_headers = await _read_headers(reader)
        if status != 200:
            text = b"".join([c async for c in _body(reader, response_headers)])
            raise HTTPError(f"HTTP {status}: {text.decode(errors='replace')[:500]}")
        async for chunk in _body(reader, response_headers):
            yield chunk
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = [f"GET {parts.path or '/'} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        status, response_headers = await _read_headers(reader)
        text = b"".join([c async for c in _body(reader, response_headers)])
        if status != 200:
            raise HTTPError(f"HTTP {status}: {text.decode(errors='replace')[:500]}")
        return json.loads(text)
    finally:
        writer.close()


def sse_events(lines: list[bytes], data: bytes) -> list[str]:
    """Feed bytes into the pending partial line `lines` (a one-element buffer); return the
    payloads of the complete `data:` lines."""
    buffer = lines[0] + data
    *complete, lines[0] = buffer.split(b"\n")
    out = []
    for line in complete:
        line = line.rstrip(b"\r")
        if line.startswith(b"data:"):
            out.append(line[5:].strip().decode())
    return out


# ---- one request ------------------------------------------------------------------------


@dataclass
class Endpoint:
    url: str  # e.g. http://127.0.0.1:8000/v1/completions
    model: str
    chat: bool = False  # /v1/chat/completions: the prompt becomes one user message
    headers: dict[str, str] | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None


def request_payload(endpoint: Endpoint, request: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = dict(
        model=endpoint.model,
        max_tokens=request.expected_output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if endpoint.chat:
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (use a tokenizer)")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = payload.pop("max_tokens")
    else:
        payload["prompt"] = request.prompt
    if endpoint.ignore_eos:
        payload["ignore_eos"] = True
    payload |= endpoint.extra_body or {}
    return payload


async def send_request(
    endpoint: Endpoint,
    request: SampleRequest,
    *,
    t0: float,
    clock: Callable[[], float] = time.perf_counter,
    timeout: float = 600.0,
) -> RequestResult:
    """Stream one completion; time its content chunks from just before the POST."""
    result = RequestResult(success=False, prompt_len=request.prompt_len)
    payload = request_payload(endpoint, request)
    start = clock()
    result.start_time = start - t0
    last = start
    chunks = 0
    usage_tokens = None
    text: list[str] = []
    pending = [b""]
    try:
        async with asyncio.timeout(timeout):
            async for data in post_stream(endpoint.url, payload, endpoint.headers):
                now = clock()
                for event in sse_events(pending, data):
                    if event == "[DONE]":
                        continue
                    message = json.loads(event)
                    if "error" in message:
                        raise HTTPError(str(message["error"])[:500])
                    if message.get("usage"):
                        usage_tokens = message["usage"].get("completion_tokens")
                    for choice in message.get("choices") or []:
                        piece = (
                            (choice.get("delta") or {}).get("content")
                            if endpoint.chat
                            else choice.get("text")
                        )
                        if not piece:
                            continue
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                        text.append(piece)
        if chunks == 0:
            raise HTTPError("the stream ended without any content")
        result.latency = last - start
        result.output_len = usage_tokens if usage_tokens is not None else chunks
        result.generated_text = "".join(text)
        result.success = True
    except (OSError, TimeoutError, HTTPError, ValueError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_requests(
    endpoint: Endpoint,
    requests: list[SampleRequest],
    offsets: list[float],
    *,
    max_concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send request i at offsets[i] seconds (at most `max_concurrency` in flight, later ones
    wait for a slot); returns the results in request order and the benchmark's duration."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(request: SampleRequest, offset: float) -> RequestResult:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            result = await send_request(endpoint, request, t0=t0, timeout=timeout)
        else:
            async with semaphore:
                result = await send_request(endpoint, request, t0=t0, timeout=timeout)
        if on_done is not None:
            on_done(result)
        return result

    results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    return list(results), time.perf_counter() - t0
