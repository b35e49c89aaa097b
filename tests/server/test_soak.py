"""Soak: a real server process under a mixed, hostile load.

Concurrent clients send requests with random prompt and output lengths (many sharing system
prefixes, so the prefix cache works), greedy and seeded sampling, streaming or not; about
10% are aborted mid-stream and about 5% are invalid. The page pool is small enough to force
preemption. Every valid request that is not aborted must end with exactly the tokens offline
generation gives; every invalid one must get a 4xx; no answer may be a 5xx; afterwards
nothing runs or waits, every KV page is free, and the log holds no error.

The CI version sends 300 requests; `--runslow` adds a long one (JAXCB_SOAK_REQUESTS,
default 10,000).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from server_helpers import MODEL, ServerProcess, metric, scrape, wait_idle

from jaxcb import SamplingParams

CONFIG = {
    "model": "jaxcb-tiny-random-llama-v1",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "token_buckets": "16 32 64",
    "max_model_len": 256,
    "page_size": 8,
    # 48 pages = 384 tokens for 8 running sequences of up to ~150: preemption is routine
    "num_pages": 48,
    "max_n": 2,
    "max_output_tokens": 24,
}
ARGS = [a for k, v in CONFIG.items() for a in (f"--{k.replace('_', '-')}", *str(v).split())]
VOCAB = 320  # the built-in tiny model's
CONCURRENCY = 24


@dataclass
class Job:
    index: int
    body: dict[str, Any] | bytes
    path: str = "/v1/completions"
    valid: bool = True
    abort_after: int | None = None  # stream events to read before hanging up
    # filled in by the client
    status: int | None = None
    token_ids: list[list[int]] = field(default_factory=list)  # per choice
    finish: list[str | None] = field(default_factory=list)
    error: str | None = None


def make_jobs(num: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(24, 72))] for _ in range(4)]
    jobs = []
    for i in range(num):
        roll = rng.random()
        if roll < 0.05:
            jobs.append(invalid_job(i, rng))
            continue
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))]
        prompt = (rng.choice(prefixes) + own) if rng.random() < 0.6 else own
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": rng.randint(1, 24),
            "return_token_ids": True,
        }
        kind = rng.random()
        if kind < 0.6:
            body["temperature"] = 0
        else:  # seeded sampling (see check_results)
            body |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
            body["ignore_eos"] = True
            if kind > 0.9:
                body["n"] = 2
        if rng.random() < 0.5:
            body["ignore_eos"] = True
        stream = rng.random() < 0.6 or roll < 0.15
        body["stream"] = stream
        abort_after = rng.randint(1, 3) if roll < 0.15 else None
        if abort_after is not None:
            body |= {"max_tokens": 24, "ignore_eos": True}  # long enough to be cut
        jobs.append(Job(i, body, abort_after=abort_after))
    return jobs


def invalid_job(i: int, rng: random.Random) -> Job:
    base = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}
    bodies: list[dict | bytes] = [
        {**base, "prompt": [5] * 300},  # longer than max_model_len
        {**base, "prompt": [5] * 250, "max_tokens": 10},  # prompt + max_tokens too long
        {**base, "temperature": -1},
        {**base, "max_tokens": 0},
        {**base, "max_tokens": 25},  # over max_output_tokens
        {**base, "n": 3},  # over max_n
        {**base, "model": "no-such-model"},
        {**base, "prompt": [5, VOCAB + 7]},
        {**base, "prompt": []},
        {**base, "top_p": 0},
        {**base, "logprobs": 50},
        {**base, "stream_options": {"include_usage": True}},
        {**base, "temperature": "hot"},
        {**base, "priority": 3},  # needs the priority policy
        {"model": MODEL, "max_tokens": 4},  # no prompt
        {**base, "stop": [""]},
        b'{"model": "' + MODEL.encode() + b'", "prompt": [1, 2',  # truncated JSON
        b"\xff\xfe not json",
    ]
    body = rng.choice(bodies)
    if isinstance(body, dict) and "stream_options" not in body and rng.random() < 0.3:
        body = {**body, "stream": True}
    path = "/v1/completions"
    if rng.random() < 0.15:
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": []}
    return Job(i, body, path=path, valid=False)


# ---- a minimal HTTP/1.1 client on asyncio streams (hanging up is just closing) -----------


async def call(host: str, port: int, job: Job) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = job.body if isinstance(job.body, bytes) else json.dumps(job.body).encode()
        head = (
            f"POST {job.path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        status_line = await reader.readline()
        job.status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            await read_events(reader, job)
        else:
            payload = json.loads(await reader.read())
            read_response(payload, job)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_events(reader: asyncio.StreamReader, job: Job) -> None:
    buffer, events = b"", 0
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                job.error = chunk["error"]["message"]
                continue
            for choice in chunk["choices"]:
                k = choice["index"]
                while len(job.token_ids) <= k:
                    job.token_ids.append([])
                    job.finish.append(None)
                job.token_ids[k] += choice.get("token_ids") or []
                job.finish[k] = choice["finish_reason"] or job.finish[k]
            events += 1
            if job.abort_after is not None and events >= job.abort_after:
                return  # hang up mid-stream


def read_response(payload: dict, job: Job) -> None:
    if "error" in payload:
        job.error = payload["error"]["message"]
        return
    for choice in sorted(payload["choices"], key=lambda c: c["index"]):
        job.token_ids.append(choice["token_ids"])
        job.finish.append(choice["finish_reason"])


async def run_load(url: str, jobs: list[Job]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker() -> None:
        while not queue.empty():
            job = queue.get_nowait()
            await asyncio.wait_for(call(host, int(port), job), timeout=120)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


# ---- the test -------------------------------------------------------------------------------


def soak(tmp_path, num_requests: int, seed: int) -> None:
    server = ServerProcess(ARGS, tmp_path / "soak-server.log")
    try:
        from jaxcb import LLM

        server.wait_ready()
        # the offline engine must compute exactly as the server does: same attention backend
        backend = re.search(r"attention (\S+), matmul", server.log()).group(1)
        reference = LLM(**{**CONFIG, "token_buckets": [16, 32, 64]}, attention=backend)
        jobs = make_jobs(num_requests, seed)
        asyncio.run(run_load(server.url, jobs))
        after = wait_idle(server.url, timeout=60)
        check_results(jobs, reference)
        assert metric(after, "jaxcb:kv_cache_usage_perc") == 0
        assert metric(after, "jaxcb:num_preemptions_total") > 0, "the pool was meant to preempt"
        assert metric(after, "jaxcb:prefix_cache_hits_total") > 0
        aborted = sum(j.abort_after is not None for j in jobs)
        assert metric(after, "jaxcb:request_success_total", finished_reason="abort") >= (
            aborted * 0.5
        )  # most hang-ups land before their request ends
        assert scrape(server.url) is not None
        log = server.log()
        assert "Traceback" not in log and " ERROR " not in log, server.tail()
    finally:
        status = server.stop()
    assert status == 0, server.tail()


def check_results(jobs: list[Job], reference) -> None:
    assert all(job.status is not None for job in jobs), "a request got no answer"
    server_errors = [(j.index, j.status, j.error) for j in jobs if j.status >= 500]
    assert not server_errors, server_errors[:5]
    for job in jobs:
        if not job.valid:
            assert 400 <= job.status < 500, (job.index, job.body, job.status)
    done = [j for j in jobs if j.valid and j.abort_after is None]
    assert len(done) >= len(jobs) * 0.75
    for job in done:
        assert job.status == 200 and job.error is None, (job.index, job.status, job.error)
    want = reference.generate(
        [job.body["prompt"] for job in done],
        [sampling_params(job.body) for job in done],
        use_tqdm=False,
    )
    sampled = differ = 0
    for job, expected in zip(done, want, strict=True):
        tokens = [o.token_ids for o in expected.outputs]
        assert job.finish == [o.finish_reason for o in expected.outputs], job.index
        assert [len(t) for t in job.token_ids] == [len(t) for t in tokens], job.index
        if job.body["temperature"] == 0:
            assert job.token_ids == tokens, job.index
        else:
            sampled += 1
            differ += job.token_ids != tokens
    # A seeded request draws with the same keys whatever shares its batch, but its logits
    # are only equal up to float rounding, which depends on the step's bucket: a draw that
    # lands within rounding of a token boundary can flip (1 in ~150 here, now and then). A
    # seed that were not honoured would make nearly all of them differ.
    assert differ <= max(2, sampled // 20), f"{differ} of {sampled} seeded requests differ"
    for job in jobs:
        if job.abort_after is not None and job.token_ids:
            assert all(f in (None, "length") for f in job.finish)


def sampling_params(body: dict) -> SamplingParams:
    keys = ("max_tokens", "temperature", "top_p", "seed", "n", "ignore_eos")
    return SamplingParams(**{k: body[k] for k in keys if k in body})


def test_soak_300_requests(tmp_path):
    soak(tmp_path, num_requests=300, seed=0)


@pytest.mark.slow
def test_soak_long(tmp_path):
    soak(tmp_path, num_requests=int(os.environ.get("JAXCB_SOAK_REQUESTS", "10000")), seed=1)
