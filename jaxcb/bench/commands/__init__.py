"""The benchmark family: `python -m jaxcb.bench NAME [flags]` runs the module NAME of this folder.

A benchmark is one module here (its file name is its NAME; a name starting with `_` is not a
command). It holds:

    the module docstring       its --help text (what it measures, how to read it, examples)
    DESCRIPTION                one line, listed by `python -m jaxcb.bench --help`
    FLAGS = SharedFlags(...)   which shared flags it takes, and its defaults for them
                               (absent: --json only)
    add_arguments(parser)      its own flags
    check_args(parser, args)   optional: flag combinations that cannot run, as parser.error
    run(args, record)          the benchmark: prints its table, fills `record` (what --json
                               writes), returns the exit status (None: 0); a UsageError it
                               raises (a flag found wrong only once it runs) is reported as
                               parser.error

The entry point adds the shared flags, prints the machine line (the CPU, its flags, the ISA
level jaxcb's kernels run at: `jaxcb.bench.cli.machine_record`) before `run`, and after it
writes --json: `benchmark` (the name), `args` (the flags as parsed and checked), `machine`,
then `record`'s own keys. Nothing outside `jaxcb/bench/` imports these modules.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from jaxcb.bench.cli import CONFIG_HELP, MODEL_HELP, args_record, machine_record
from jaxcb.runtime.platforms import restrict_to_present_hardware

PROG = "python -m jaxcb.bench"


class UsageError(ValueError):
    """A flag value a benchmark finds wrong only once it runs: reported as a usage error."""


@dataclass(frozen=True)
class SharedFlags:
    """The family's flags a benchmark takes (one spelling for all), and its defaults."""

    json: bool = True  # --json PATH: the record, with the machine and the flags
    machine: bool = True  # print the machine line first (a tool that measures nothing: off)
    repeats: int | None = None  # --repeats N with this default (None: it repeats nothing)
    repeats_help: str = "timed repetitions; the median is reported"
    repeats_alias: str | None = None  # an old spelling of --repeats, still accepted
    model: bool = False  # --model
    default_model: str | None = None
    model_help: str = MODEL_HELP
    dtype: str | None = None  # --dtype float32|bfloat16 with this default (None: no --dtype)
    config: bool = False  # --config YAML
    config_help: str = CONFIG_HELP


def command_names() -> list[str]:
    """Every benchmark's NAME: the modules of this folder, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> ModuleType:
    """The benchmark module NAME."""
    return importlib.import_module(f"{__name__}.{name}")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_shared_args(parser: argparse.ArgumentParser, flags: SharedFlags) -> None:
    """The shared flags `flags` asks for, in a group of their own."""
    group = parser.add_argument_group("shared by the benchmarks")
    if flags.model:
        help_ = flags.model_help + (" (default: %(default)s)" if flags.default_model else "")
        group.add_argument("--model", default=flags.default_model, help=help_)
    if flags.dtype:
        group.add_argument(
            "--dtype",
            default=flags.dtype,
            choices=["float32", "bfloat16"],
            help="the model's weights and activations, or the arrays a micro-benchmark times "
            "(%(default)s)",
        )
    if flags.config:
        group.add_argument("--config", type=Path, help=flags.config_help)
    if flags.repeats is not None:
        group.add_argument(
            "--repeats",
            type=positive_int,
            default=flags.repeats,
            metavar="N",
            help=f"{flags.repeats_help} (%(default)s)",
        )
        if flags.repeats_alias:  # hidden: its own default must not mask --repeats'
            group.add_argument(
                flags.repeats_alias,
                dest="repeats",
                type=positive_int,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    if flags.json:
        group.add_argument(
            "--json",
            type=Path,
            metavar="PATH",
            help="write the results here, with the flags and the machine record",
        )


def command_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """NAME's parser: its docstring as the description, the shared flags, its own."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_shared_args(parser, getattr(module, "FLAGS", SharedFlags()))
    module.add_arguments(parser)
    return parser


def top_parser(names: list[str]) -> argparse.ArgumentParser:
    """`python -m jaxcb.bench`: NAME, and every benchmark listed with its DESCRIPTION."""
    width = max(map(len, names))
    listing = "\n".join(f"  {n:<{width}}  {load(n).DESCRIPTION}" for n in names)
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} NAME [flags]",
        description="jaxcb's benchmarks and their tools, one family: shared flags (--json, "
        "--repeats, --model, --dtype, --config where they apply), the machine line first.",
        epilog=f"benchmarks:\n{listing}\n\n`{PROG} NAME --help` explains NAME's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", metavar="NAME", choices=names, help="the benchmark to run")
    return parser


def write_record(
    path: Path, name: str, args: argparse.Namespace, machine: dict | None, record: dict
) -> None:
    """--json: the benchmark, its flags, the machine record, then what it recorded (a key of
    its own named like one of those three is an error, not an overwrite)."""
    body = dict(benchmark=name, args=args_record(args), machine=machine, **record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run `python -m jaxcb.bench NAME [flags]`; returns the benchmark's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = command_names()
    if not argv or argv[0] not in names:
        top_parser(names).parse_args(argv[:1])  # exits: the listing for --help, else usage
    name = argv[0]
    # As the engine does: no failed GPU / TPU probes on a machine without them (the micro-
    # benchmarks touch jax before any engine is built).
    restrict_to_present_hardware()
    module = load(name)
    parser = command_parser(name, module)
    args = parser.parse_args(argv[1:])
    if hasattr(module, "check_args"):
        module.check_args(parser, args)
    flags = getattr(module, "FLAGS", SharedFlags())
    machine = None
    if flags.machine:
        machine = machine_record()
    record: dict[str, Any] = {}
    try:
        status = module.run(args, record) or 0
    except UsageError as exc:
        parser.error(str(exc))
    if flags.json and args.json is not None:
        write_record(args.json, name, args, machine, record)
    return status
