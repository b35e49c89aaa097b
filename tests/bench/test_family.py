"""The benchmark family: `python -m jaxcb.bench --help` lists every module of
jaxcb/bench/commands/, each command's --help works without loading anything heavy, the shared
flags are spelled one way, and --json always carries the machine record and the flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from jaxcb.bench.commands import SharedFlags, command_names, load, main

COMMANDS = REPO / "jaxcb" / "bench" / "commands"


def test_the_listing_names_every_command_module() -> None:
    files = sorted(p.stem for p in COMMANDS.glob("*.py") if not p.stem.startswith("_"))
    assert command_names() == files
    run = subprocess.run(
        [sys.executable, "-m", "jaxcb.bench", "--help"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for name in files:
        (line,) = [x for x in lines if x.split()[:1] == [name]]
        assert load(name).DESCRIPTION in line


@pytest.mark.parametrize("name", command_names())
def test_each_command_explains_itself(name: str, capsys) -> None:
    module = load(name)
    assert module.__doc__ and module.DESCRIPTION and "\n" not in module.DESCRIPTION
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m jaxcb.bench {name}")
    flags = getattr(module, "FLAGS", SharedFlags())
    assert ("--json PATH" in out) == flags.json
    assert ("--repeats N" in out) == (flags.repeats is not None)


def test_json_carries_the_machine_and_the_flags(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate_routing", "--num-replicas", "2", "--num-requests", "50", "--rate", "5",
            "--num-groups", "4", "--policies", "prefix", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "simulate_routing"
    assert record["args"]["num_requests"] == 50 and record["args"]["json"] == str(out)
    assert {"cpu", "flags", "isa_level", "cores"} <= set(record["machine"])
    assert set(record["results"]) == {"prefix"}
    assert capsys.readouterr().out.startswith("machine: ")


def test_an_unknown_benchmark_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
