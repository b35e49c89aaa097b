"""The cache directory: an unwritable $JAXCB_CACHE_DIR costs one warning line, not a crash."""

from __future__ import annotations

import logging
import os

from helpers import ONE_BUCKET_GENERATE, run_script

from jaxcb import paths


def test_unwritable_cache_dir_falls_back_to_a_temporary_one(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(paths.ENV_VAR, str(blocker / "cache"))  # a path through a file
    with caplog.at_level(logging.WARNING, logger="jaxcb.paths"):
        first = paths.cache_dir()
        second = paths.cache_dir()
    assert first == second and first.is_dir() and not str(first).startswith(str(blocker))
    (warning,) = caplog.records  # once per process, however often it is asked
    assert str(blocker / "cache") in warning.getMessage()
    assert paths.ENV_VAR in warning.getMessage()


def test_writable_cache_dir_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.ENV_VAR, str(tmp_path / "jaxcb"))
    assert paths.cache_dir() == tmp_path / "jaxcb"
    assert (tmp_path / "jaxcb").is_dir()


def test_generate_with_an_unwritable_cache_prints_one_line_and_no_traceback(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, JAXCB_CACHE_DIR=str(blocker / "cache"), JAX_PLATFORMS="cpu")
    args = ["--log-level", "WARNING", "--attention", "xla", "--matmul", "xla"]
    result = run_script("generate", ["Hi", *ONE_BUCKET_GENERATE, *args], env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    about_cache = [line for line in result.stderr.splitlines() if "JAXCB_CACHE_DIR" in line]
    assert len(about_cache) == 1, result.stderr
    assert str(blocker / "cache") in about_cache[0]
    assert "completion:" in result.stdout
