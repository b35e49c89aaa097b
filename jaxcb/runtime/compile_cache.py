"""jax's persistent compilation cache, so a second start skips compiling the buckets."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxcb.paths import cache_dir

logger = logging.getLogger(__name__)

STEP_ENTRY_PREFIX = "jit_packed_step-"  # cache files of the step function (step.packed_step)


def configure(setting: str) -> Path | None:
    """Point jax at the cache directory for `setting` ("auto", "off" or a path).

    A cache directory the user already configured (JAX_COMPILATION_CACHE_DIR or
    jax.config) wins over "auto". Every compilation is cached, however quick: a server with
    many buckets starts in seconds the second time.
    """
    configured = jax.config.jax_compilation_cache_dir
    if setting == "off":  # for the whole process, as jax's cache is process-wide
        if configured:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
        return None
    if setting == "auto":
        path = Path(configured) if configured else cache_dir() / "xla"
    else:
        path = Path(setting).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning(
            "the compilation cache directory %s cannot be created (%s): compiling without a "
            "persistent cache; set compilation_cache to a writable directory or 'off'",
            path,
            exc.strerror or type(exc).__name__,
        )
        return None
    if configured != str(path) or jax.config.jax_persistent_cache_min_compile_time_secs != 0:
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()  # take the new settings even after earlier compiles
    return path


def count_step_entries(path: Path | None) -> int:
    """Cache entries of the step function (used to tell cache hits from fresh compiles)."""
    if path is None or not path.is_dir():
        return 0
    return sum(1 for p in path.iterdir() if p.name.startswith(STEP_ENTRY_PREFIX))
