"""Test configuration: CPU only, one cache dir per test run, --runslow, and the workers.

pytest runs the suite on `-n auto` workers (pytest-xdist, pyproject.toml's addopts), one per
core as memory allows, whole modules to a worker (--dist loadscope: module fixtures are built
once). The workers of a run share one cache dir: the default models are built once and a
step program compiled by one worker (or by a server process a test starts) is loaded from
jax's persistent cache by the others.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: give --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


#: Peak memory of one worker (engines, transformers references, compiled programs).
WORKER_BYTES = 6 * 2**30


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """-n auto: a worker per core, as many as memory holds at WORKER_BYTES each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores or 1, memory // WORKER_BYTES))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build the default models and cache compiled programs in one cache dir per test run
    (shared by its workers), never in the user's home."""
    if "JAXCB_CACHE_DIR" not in os.environ:
        root = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp/popen-gwN: the run's folder above
            root = root.parent
        path = root / "jaxcb-cache"
        path.mkdir(exist_ok=True)
        os.environ["JAXCB_CACHE_DIR"] = str(path)
