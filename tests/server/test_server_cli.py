"""scripts/serve.py's start-up checks, without an engine: they fail fast, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_helpers import REPO, SERVE

from jaxcb.server import ServerSettings


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
