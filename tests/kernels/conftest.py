"""Kernel tests: make the repo root (pallas_kernels) and this folder (rpa_cases) importable.

Both are inserted explicitly so the tests run from a plain checkout (no `pip install -e .`)
and whatever pytest's import mode or `__init__.py` files later present in tests/.
"""

from __future__ import annotations

import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
for _path in (_HERE.parents[1], _HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
