"""Helpers of the server tests: start `scripts/serve.py`, plain HTTP calls, /metrics scraping.

`--port 0` lets the server pick a free port; its startup log prints the URL, which
`ServerProcess.wait_ready` reads from the log file.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
SERVE = REPO / "scripts" / "serve.py"
ENGINE_CONFIG = {
    "model": "jaxcb-tiny-random-llama-v1",  # the built-in tiny random-weight model
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "max_model_len": 512,
    "num_pages": 64,
}
ENGINE_ARGS = [
    arg
    for name, value in ENGINE_CONFIG.items()
    for arg in (f"--{name.replace('_', '-')}", str(value))
]
MODEL = "jaxcb-tiny-random-llama-v1"  # the built-in model's served name
STARTUP_TIMEOUT = 300.0


class ServerProcess:
    """A `scripts/serve.py ARGS --host 127.0.0.1 --port 0` process, started at once."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        cmd = [sys.executable, str(SERVE), *args, "--host", "127.0.0.1", "--port", "0"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )
        self.url = ""  # http://127.0.0.1:PORT, known once the log prints it

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        """Wait until the log shows the URL and /health answers 200."""
        deadline = time.monotonic() + timeout
        while not self.url or _get_status(self.url + "/health") != 200:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start in {timeout}s:\n{self.tail()}")
            if not self.url:
                match = re.search(r"listening on: (http://\S+)", self.log())
                self.url = match.group(1) if match else ""
            time.sleep(0.2)
        return self

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname, parts.port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server (if still running) and wait; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def run_server(args: list[str], log_path: Path) -> Iterator[ServerProcess]:
    """Start a server, wait until it is ready, and stop it afterwards."""
    server = ServerProcess(args, log_path)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _get_status(url: str) -> int | None:
    try:
        return request("GET", url)[0]
    except OSError:
        return None


# ---- plain HTTP helpers -------------------------------------------------------------------


def request(
    method: str,
    url: str,
    body: bytes | dict | None = None,
    headers: dict[str, str | None] | None = None,
    timeout: float = 60.0,
) -> tuple[int, Any]:
    """One HTTP request with the standard library; returns (status, JSON or text). A header
    given as None is not sent."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        hdrs = {name: value for name, value in hdrs.items() if value is not None}
        conn.request(method, parts.path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        if resp.getheader("content-type", "").startswith("application/json"):
            return resp.status, json.loads(raw)
        return resp.status, raw.decode(errors="replace")
    finally:
        conn.close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed by prometheus-client: {(sample name, sorted labels): value}."""
    status, text = request("GET", url + "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        v
        for (n, lbls), v in samples.items()
        if n == name and all(dict(lbls).get(k) == val for k, val in labels.items())
    )


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Wait until nothing runs or waits and every KV page is free; returns the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        busy = [
            metric(samples, n)
            for n in (
                "jaxcb:num_requests_running",
                "jaxcb:num_requests_waiting",
                "jaxcb:kv_cache_usage_perc",
            )
        ]
        if not any(busy):
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"server still busy after {timeout}s: running, waiting, kv = {busy}")
        time.sleep(0.05)


def wait_for_metrics(url: str, predicate: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    """Scrape /metrics until `predicate(samples)` holds; returns those samples."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"/metrics did not reach the expected state in {timeout}s")
        time.sleep(0.02)


def open_raw_request(
    server: ServerProcess, path: str, body: dict, headers: dict[str, str] | None = None
) -> socket.socket:
    """Send a POST on a raw socket and return the socket, so a test can drop the connection."""
    host, port = server.host_port
    sock = socket.create_connection((host, port), timeout=60)
    data = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(data)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
    return sock


def read_events(sock: socket.socket, count: int | None = None) -> bytes:
    """Read a raw SSE response until `count` events have arrived, or (count None) until
    `data: [DONE]` or the end of the connection."""
    buf = b""
    while buf.count(b"data: ") < count if count is not None else b"data: [DONE]" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def sse_payloads(raw: bytes) -> list[str]:
    """The `data:` payloads of a raw chunked text/event-stream response, in order."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        body, rest = body + rest[:size], rest[size + 2 :]
        if size == 0:
            break
    events = body.decode().split("\n\n")
    return [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
