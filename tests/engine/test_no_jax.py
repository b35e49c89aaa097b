"""The host side of the engine never imports jax (DESIGN.md: "no jax import"): every module
under jaxcb/engine/, and the host-side leaves it builds on, import cleanly in a process
that then holds no jax module. (tests/test_import_directions.py checks the source.)"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import jaxcb

ENGINE_DIR = Path(jaxcb.__file__).parent / "engine"
HOST_MODULES = [
    *(m.name for m in pkgutil.walk_packages([str(ENGINE_DIR)], prefix="jaxcb.engine.")),
    "jaxcb.offline.driver",
    "jaxcb.offline.ordering",
    "jaxcb",
    "jaxcb.config",
    "jaxcb.sampling_params",
    "jaxcb.outputs",
    "jaxcb.paths",
    "jaxcb.cli",
]


def test_every_engine_module_is_listed() -> None:
    names = set(HOST_MODULES)
    for expected in ("sched.scheduler", "llm_engine", "replicated", "interface", "sched.factory"):
        assert f"jaxcb.engine.{expected}" in names


def test_host_modules_do_not_import_jax() -> None:
    code = "\n".join(
        [
            "import importlib, sys",
            *(f"importlib.import_module({m!r})" for m in HOST_MODULES),
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))",
            "assert not bad, bad[:10]",
            "print('ok')",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
