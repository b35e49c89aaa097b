"""Where jaxcb keeps what it builds once per machine: the default model, the native kernels'
library, the XLA compilation cache. A leaf module (standard library only): every box may
import it.

The cache directory is $JAXCB_CACHE_DIR, else $XDG_CACHE_HOME/jaxcb, else ~/.cache/jaxcb. If it
cannot be written (a read-only home, a path through a file), jaxcb falls back to a fresh
temporary directory for this process and says so in one warning line: everything still runs,
but nothing built is reused by the next process.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "JAXCB_CACHE_DIR"


def configured_cache_dir() -> Path:
    """The cache directory the environment asks for (it may not exist or be writable)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxcb"


def cache_dir() -> Path:
    """The configured cache directory, created if needed; a temporary one if it cannot be
    written (see the module docstring)."""
    return _usable(configured_cache_dir())


@functools.cache
def _usable(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
        return path
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="jaxcb-cache-"))
        logger.warning(
            "the jaxcb cache directory %s is not writable (%s; set %s to a writable "
            "directory): using %s for this process, so nothing built now is reused later",
            path,
            exc.strerror or type(exc).__name__,
            ENV_VAR,
            fallback,
        )
        return fallback


def build_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """write(a fresh temporary dir beside `target`), then rename it to `target` (a model
    directory: it has a config.json once written). Atomic: a concurrent builder may win,
    which is fine, and a reader never sees half a directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; other users' venvs read it too
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
