"""`python -m jaxcb.bench plot_trace` without matplotlib: one line naming the pip command.

(Drawing a real trace is tested with the batching modes, tests/e2e/test_batching_modes.py.)"""

from __future__ import annotations

import json
import sys

import pytest

from jaxcb.bench.commands import main


def test_without_matplotlib_it_stops_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"format": "jaxcb-step-trace-v1", "meta": {}, "steps": []}))
    with pytest.raises(SystemExit) as exit_:
        main(["plot_trace", str(trace)])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.endswith('plots need matplotlib: pip install "jaxcb[bench]"'), line
