"""Compile every bucket's step for a TPU or an H100 that is not here, and report what it costs.

    python scripts/aot_compile.py --target h100 --config configs/llama3-8b-h100.yaml \\
        --model configs/models/llama3-8b/config.json
    python scripts/aot_compile.py --target v5e:2x2 --config configs/qwen3-8b-v5e-4.yaml \\
        --model configs/models/qwen3-8b/config.json --json out.json

The model is a Hugging Face config.json (or its directory): the parameters are abstract
shapes, no weights are read. Every EngineConfig field is a flag, as for serve.py. Needs
jax[tpu] (TPU targets) or jax[cuda12] (GPU targets): `pip install -e '.[test]'` has both.

Prints per bucket the compile seconds, memory per chip (arguments, outputs, temporaries,
aliased), flops and bytes accessed, the bytes an ideal step moves, the roofline time
max(flops / peak, bytes / bandwidth) and the decode rate it implies, then whether the
weights, the KV pool and the largest step's buffers fit a chip. Exit status: 0 if it
compiled and fits, 1 if it does not fit, 2 on a bad flag or a compile error (one line).
"""

from __future__ import annotations

import os

# Before jax is imported: the host runs nothing (jax[cuda12] would fail for want of a GPU).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import logging
import sys
import traceback

from jaxcb.cli import add_engine_args, engine_config_from_args
from jaxcb.runtime import aot, aot_report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target", required=True, help=f"what to compile for: {', '.join(aot.TARGETS)}"
    )
    parser.add_argument(
        "--hbm-gb",
        type=float,
        help="a chip's memory in GB (1e9 bytes) instead of the target's (what fits a smaller part)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=aot.DEFAULT_COMPILE_THREADS,
        help="buckets compiled at once (%(default)s)",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        help="live tokens per sequence the ideal bytes assume (default: the pool's "
        "capacity over the largest bucket's sequences, at most max_model_len)",
    )
    parser.add_argument("--json", help="also write the report as JSON to this file ('-': stdout)")
    parser.add_argument("--traceback", action="store_true", help="print a failure's traceback")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    add_engine_args(parser, taken={"target"})
    return parser


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        target = aot.get_target(args.target)
        config = engine_config_from_args(args)
    except ValueError as exc:
        return fail(str(exc).splitlines()[0])
    hbm = int(args.hbm_gb * 1e9) if args.hbm_gb is not None else None

    def log(message: str) -> None:
        logging.getLogger("aot_compile").info(message)

    try:
        build = aot.compile_for_target(
            config, target, hbm_bytes=hbm, threads=args.threads, progress=True, log=log
        )
        report = aot_report.report(build, context_len=args.context_len)
    except aot.DoesNotFit as exc:
        return fail(str(exc).splitlines()[0], code=1)
    except Exception as exc:  # a compile error of any kind fails the run, in one line
        if args.traceback:
            traceback.print_exc()
        return fail(f"compiling for {target.name} failed: {one_line(exc)}")
    print(aot_report.format_report(report), flush=True)
    if args.json:
        text = json.dumps(report.to_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
