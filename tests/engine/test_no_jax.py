"""The host side of the engine never imports jax (DESIGN.md: "no jax import")."""

from __future__ import annotations

import subprocess
import sys

HOST_MODULES = [
    "jaxcb.engine.scheduler",
    "jaxcb.engine.baselines",
    "jaxcb.engine.page_pool",
    "jaxcb.engine.policies",
    "jaxcb.engine.request",
    "jaxcb.engine.buckets",
    "jaxcb.engine.detokenizer",
    "jaxcb.config",
    "jaxcb.sampling_params",
]


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
