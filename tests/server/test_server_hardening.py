"""What an abuse probe of the server found (issue 15), each checked on the shared server: a huge
prompt or body must neither stall other clients nor grow the server's memory, a client that
hangs up mid-upload logs no traceback, and the HTTP rules hold (JSON only, no redirects, no
disk paths in /v1/models)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

import pytest
from server_helpers import MODEL, open_raw_request, read_events, request, wait_idle

LONG_STREAM = {"prompt": "tick", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
BODY_LIMIT = 8 * 2**20  # the server's default --max-request-body-mb 8


def _error(answer: object, status: int, code: str | None = None) -> dict:
    assert isinstance(answer, dict) and set(answer) == {"error"}, (status, answer)
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_a_huge_prompt_is_refused_at_once_and_other_streams_go_on(server):
    """A 4 MB prompt was tokenized on the engine thread before its length was checked: every
    stream stalled for seconds. Now it is refused by its length in characters, off the
    engine thread, while a concurrent stream keeps getting tokens."""
    wait_idle(server.url)
    stream = open_raw_request(server, "/v1/completions", {**LONG_STREAM, "stream": True})
    head = read_events(stream, 3)
    assert head.startswith(b"HTTP/1.1 200"), head
    arrivals = [time.monotonic()]
    huge: dict = {}

    def send_huge() -> None:
        body = {"model": MODEL, "prompt": "x" * 4_000_000, "max_tokens": 1}
        start = time.monotonic()
        huge["answer"] = request("POST", server.url + "/v1/completions", body, timeout=60)
        huge["seconds"], huge["done"] = time.monotonic() - start, time.monotonic()

    thread = threading.Thread(target=send_huge)
    thread.start()
    tail = b""
    while b"data: [DONE]" not in tail:
        chunk = stream.recv(65536)
        if not chunk:
            break
        tail = (tail + chunk)[-64:]
        arrivals.append(time.monotonic())
    stream.close()
    thread.join(60)
    assert huge["done"] < arrivals[-1], "the stream ended before the huge request was answered"
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < 1.0, f"the stream stalled for {max(gaps):.2f} s"
    assert huge["seconds"] < 2.0
    status, answer = huge["answer"]
    assert status == 400 and _error(answer, status)["param"] == "prompt", answer
    assert "at least" in answer["error"]["message"], answer  # not tokenized
    wait_idle(server.url)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_too_large_body_is_413_and_memory_stays_flat(server):
    """64 MB sent chunked (no Content-Length) is counted as it arrives and refused past the
    limit; the server's resident memory meanwhile grows by a fraction of that."""
    pid = server.proc.pid
    base, peak, done = _rss_bytes(pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes(pid))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    host, port = server.host_port
    sock = socket.create_connection((host, port), timeout=60)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n14\r\n{"prompt": "xxxxxxxx\r\n'
        )
        chunk = b"x" * 2**20
        for _ in range(64):  # an unterminated string: whatever reads it all, parses nothing
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.sendall(b"0\r\n\r\n")
        status, answer = _read_response(sock)
    finally:
        sock.close()
        done.set()
        sampler.join()
    assert status == 413
    _error(answer, status, "request_too_large")
    grew = (peak[0] - base) / 2**20
    assert grew < 40, f"the server's RSS grew by {grew:.0f} MiB for a refused 64 MiB body"


def test_a_declared_too_large_body_is_refused_before_it_is_sent(server):
    host, port = server.host_port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % (BODY_LIMIT + 1)
        )
        status, answer = _read_response(sock)  # no byte of the body was sent
    assert status == 413
    assert str(BODY_LIMIT + 1) in _error(answer, status, "request_too_large")["message"]


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of a response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int({k.lower(): v for k, v in headers.items()}[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_only_json_bodies_are_taken(server, path, content_type):
    """What a web page can make a browser send without a CORS preflight is refused (415)."""
    body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    status, answer = request(
        "POST", server.url + path, {**body, "max_tokens": 2}, headers={"Content-Type": content_type}
    )
    assert status == 415
    assert "application/json" in _error(answer, status, "unsupported_media_type")["message"]


def test_json_with_a_charset_is_taken(server):
    headers = {"Content-Type": "Application/JSON; charset=utf-8"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    status, answer = request("POST", server.url + "/v1/completions", body, headers=headers)
    assert status == 200, answer


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions/"), ("GET", "/v1/models/")])
def test_a_trailing_slash_is_a_404_not_a_redirect(server, method, path):
    """A 307 to a Location built from the client's Host header is gone."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2} if method == "POST" else None
    status, answer = request(method, server.url + path, body, headers={"Host": "evil.example"})
    assert status == 404
    _error(answer, status)


def test_models_shows_the_served_name_not_the_path(server):
    status, answer = request("GET", server.url + "/v1/models")
    assert status == 200
    assert [m["root"] for m in answer["data"]] == [MODEL]


def test_a_client_that_hangs_up_mid_upload_logs_no_traceback(server):
    """Anyone could fill the log with 120 lines a time; now it is not even an error."""
    logged = len(server.log().splitlines())
    host, port = server.host_port
    for _ in range(3):
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": "'
            )
            time.sleep(0.1)  # the handler is reading the body when the client goes
    time.sleep(0.3)
    assert request("GET", server.url + "/health")[0] == 200
    new = server.log().splitlines()[logged:]
    assert not [line for line in new if "Traceback" in line or " ERROR " in line], new
    # (the background compile may still be logging its programs: not the requests' lines)
    new = [line for line in new if " jaxcb.runtime." not in line]
    assert len(new) <= 3 + 1, new  # a line per hang-up at most, and /health's access line
