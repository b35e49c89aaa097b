"""Shutting down (issue 15): while a SIGTERM drain runs, the server keeps accepting and answers
503, on new and on idle keep-alive connections alike; a second signal quits at once with one
log line instead of a wall of tracebacks.

One server, ended by this module: four long streams queue behind max_num_seqs=1, so the
drain (a 30 s grace) lasts seconds, until the second signal cuts it short.
"""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest
from server_helpers import ENGINE_CONFIG, open_raw_request, read_events

CONFIG = {**ENGINE_CONFIG, "max_num_seqs": 1}
ARGS = [
    *(a for k, v in CONFIG.items() for a in (f"--{k.replace('_', '-')}", str(v))),
    *("--shutdown-timeout", "30"),
]
LONG = {"prompt": "a", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
POST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


@pytest.fixture(scope="module")
def draining(start_server):
    """The server, SIGTERMed while four long streams run or wait, and an idle keep-alive
    connection opened before the signal."""
    with start_server(ARGS) as srv:
        streams = [open_raw_request(srv, "/v1/completions", LONG) for _ in range(4)]
        assert read_events(streams[0], 2).startswith(b"HTTP/1.1 200")
        idle = socket.create_connection(srv.host_port, timeout=10)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(idle)[0] == 200  # the connection stays open (HTTP/1.1 keep-alive)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "draining" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # uvicorn, told to exit, would stop accepting within 0.1 s
        yield srv, idle
        idle.close()
        for stream in streams:
            stream.close()


def _response(sock: socket.socket) -> tuple[int, dict | None]:
    """Status and JSON body of one response with a Content-Length; (0, None) if the server
    closed the connection instead of answering."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    while len(body) < int(headers[b"content-length"]):
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body) if body else None


def test_draining_keeps_accepting_and_answers_503(draining):
    """The README promised 503 for new requests while draining, but new connections were
    refused and idle keep-alive ones closed without an answer."""
    srv, idle = draining
    assert srv.proc.poll() is None, "the server did not wait for its requests"
    idle.sendall(POST)
    status, answer = _response(idle)
    assert status == 503 and answer["error"]["code"] == "shutting_down", (status, answer)
    with socket.create_connection(srv.host_port, timeout=10) as fresh:
        fresh.sendall(POST)
        status, answer = _response(fresh)
        assert status == 503 and answer["error"]["code"] == "shutting_down", (status, answer)
        fresh.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(fresh)[0] == 503


def test_a_second_signal_quits_at_once_in_one_line(draining):
    """Runs last: it ends the server. A second SIGINT dumped 33 tracebacks."""
    srv, _ = draining
    assert srv.proc.poll() is None, "the server did not wait for its requests"
    logged = len(srv.log().splitlines())
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(15) == 0
    new = srv.log().splitlines()[logged:]
    assert not [line for line in new if "Traceback" in line], new
    loud = [line for line in new if " WARNING " in line or " ERROR " in line]
    assert len(loud) == 1 and "second SIGINT: quitting now" in loud[0], new
    assert len(new) <= 6, new  # and uvicorn's few INFO lines of an exit
