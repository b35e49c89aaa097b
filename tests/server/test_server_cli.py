"""scripts/serve.py's start-up checks, without an engine: they fail fast, in one line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from server_helpers import REPO, SERVE

from jaxcb.server import ServerSettings
from jaxcb.server.cli import bind_socket, exposure_warning


@pytest.mark.parametrize("key", ["clé", "key\twith-tab", "  "])
def test_an_api_key_that_is_not_printable_ascii_is_refused(key):
    with pytest.raises(ValueError, match="--api-key must be printable ASCII"):
        ServerSettings(served_model_names=("m",), api_key=key)
    ServerSettings(served_model_names=("m",), api_key="ascii key-1")


def test_serve_refuses_a_non_ascii_key_in_one_line_before_building_anything():
    """The header was decoded as Latin-1 and compared as UTF-8: the UTF-8 form of such a key
    was refused, its Latin-1 form accepted. Such a key is refused at start-up now."""
    result = subprocess.run(
        [sys.executable, str(SERVE), "--api-key", "clé", "--port", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'é' at position 2" in lines[0], lines


@pytest.mark.parametrize(
    ("address", "key", "warns"),
    [
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("192.168.1.7", None, True),
        ("0.0.0.0", "k", False),
        ("127.0.0.1", None, False),
        ("::1", None, False),
    ],
)
def test_listening_beyond_this_machine_without_a_key_is_warned_about(address, key, warns):
    warning = exposure_warning(address, key)
    assert bool(warning) == warns
    if warns:
        assert "without --api-key" in warning and address in warning


def test_the_socket_listens_before_uvicorn_starts():
    """The start-up log names the URL before uvicorn runs; a client that connects at once
    waits in the backlog rather than being refused (a bound socket that does not listen
    refuses it)."""
    sock = bind_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()
