"""Server tests run real `scripts/serve.py` processes on 127.0.0.1 and talk to them over HTTP.

One server (the small ENGINE_CONFIG) is shared by the whole session; test_server_limits.py
starts a second one with an API key and tight limits.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# The server processes and this one may share an accelerator: none may grab most of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # server_helpers, whatever pytest's import mode
    sys.path.insert(0, str(_HERE))

from server_helpers import ENGINE_ARGS, ENGINE_CONFIG, ServerProcess, run_server  # noqa: E402

# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def start_server(tmp_path_factory) -> Callable[[list[str]], Any]:
    def start(args: list[str]):
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        return run_server(args, log_path)

    return start


@pytest.fixture(scope="session")
def _shared_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """Launches the shared server without waiting, so the reference engine (below) can
    compile while the server does."""
    srv = ServerProcess(ENGINE_ARGS, tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server(_shared_server, reference_llm) -> Iterator[ServerProcess]:
    """The shared server: the built-in tiny model with the small ENGINE_CONFIG. (It asks for
    `reference_llm` so that the two engines compile at the same time.)"""
    yield _shared_server.wait_ready()
    status = _shared_server.stop(signal.SIGINT)
    assert status == 0, f"server exited with {status} on SIGINT:\n{_shared_server.tail()}"


@pytest.fixture(scope="session")
def reference_llm(_shared_server):
    """The offline engine with the server's config, for the tokens a request must produce."""
    from jaxcb import LLM

    return LLM(**ENGINE_CONFIG)


@pytest.fixture
def openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    yield client
    client.close()
