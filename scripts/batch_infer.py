"""Offline batch inference over a JSONL file; resumable (jaxcb/offline/batch.py has the details).

    python scripts/batch_infer.py --input prompts.jsonl --output results.jsonl
    python scripts/batch_infer.py --input prompts.jsonl --output results.jsonl \\
        --model /path/to/model --config configs/llama3-8b-h100.yaml --max-tokens 256

Each input line is {"id": ..., "prompt": "..." or [token ids]} or {"id": ..., "messages":
[...]}, with optional per-line sampling fields (max_tokens, temperature, top_p, stop, seed,
...). Results are appended to --output as they finish, one line each with the input's id;
bad lines go to --errors (default: OUTPUT.errors.jsonl). Run the same command again after a
crash or Ctrl-C: ids already written are skipped. --order prefix|auto submits each
--prefetch window so that prompts sharing a prefix run together. Exit status: 0 when every
line is done (bad lines included: they are in --errors), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from jaxcb.build import build_engine
from jaxcb.cli import add_engine_args, engine_config_from_args
from jaxcb.offline.batch import run_batch
from jaxcb.offline.ordering import ORDERS
from jaxcb.offline.ray_batch import add_ray_args, ray_engine_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, type=Path, help="JSONL prompts")
    parser.add_argument("--output", required=True, type=Path, help="JSONL results (appended)")
    parser.add_argument(
        "--errors", type=Path, default=None, help="JSONL of bad lines (OUTPUT.errors.jsonl)"
    )
    defaults = parser.add_argument_group("sampling defaults (a line's own fields win)")
    defaults.add_argument("--max-tokens", type=int, default=256)
    defaults.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    defaults.add_argument("--top-p", type=float, default=1.0)
    defaults.add_argument("--top-k", type=int, default=0)
    defaults.add_argument(
        "--sampling-seed",
        type=int,
        default=0,
        help="lines without a seed get one from this and their id, the same in every run",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="requests in the engine at once (default: 2 x max_num_seqs x data_parallel_size)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=512,
        help="lines prepared ahead; with --order prefix|auto, the window ordered at once",
    )
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="arrival",
        help="arrival: file order; prefix: prompts sharing a prefix (a KV page or more) go in "
        "together so it is computed once; auto: those groups, decode-heavy first. prefix and "
        "auto order each window of --prefetch requests, not the whole file; results and "
        "resuming are the same in every order (default: %(default)s)",
    )
    parser.add_argument(
        "--max-line-mb",
        type=float,
        default=8.0,
        help="a longer line goes to --errors without being read (MiB; default: %(default)s)",
    )
    parser.add_argument(
        "--num-shards",
        type=int,
        default=1,
        help="split the file between this many independent jobs (one per host, say), each "
        "with its own --output",
    )
    parser.add_argument(
        "--shard-index", type=int, default=0, help="this job's share: lines numbered i mod N"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ...")
    add_ray_args(parser)
    add_engine_args(parser, taken={a.dest for a in parser._actions})
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    errors_path = args.errors or args.output.with_name(args.output.name + ".errors.jsonl")
    if not args.input.is_file():
        parser.error(f"--input {args.input} is not a file")
    if not args.max_line_mb > 0:
        parser.error(f"--max-line-mb must be > 0, got {args.max_line_mb}")
    try:
        config = engine_config_from_args(args)
        if args.ray:  # engines in Ray actors (jaxcb/offline/ray_batch.py)
            engine = ray_engine_from_args(config, args)
        else:
            progress = not args.no_progress and sys.stderr.isatty()
            engine = build_engine(config, compile_progress=progress)
    except (ValueError, ImportError) as exc:
        parser.exit(2, f"batch_infer.py: error: {exc}\n")
    max_in_flight = args.max_in_flight or getattr(
        engine,
        "suggested_in_flight",
        2 * config.scheduler.max_num_seqs * config.parallel.data_parallel_size,
    )
    import jax

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends like Ctrl-C
    try:
        stats = run_batch(
            engine,
            args.input,
            args.output,
            errors_path,
            defaults=dict(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
            ),
            base_seed=args.sampling_seed,
            max_in_flight=max_in_flight,
            prefetch=args.prefetch,
            max_line_bytes=int(args.max_line_mb * 2**20),
            progress=not args.no_progress,
            writer=jax.process_index() == 0,  # multi-host: process 0 writes
            shard=(args.shard_index, args.num_shards),
            order=args.order,
        )
    except ValueError as exc:  # a bad --shard-index, an unreadable output file
        parser.exit(2, f"batch_infer.py: error: {exc}\n")
    except KeyboardInterrupt:
        engine.close()
        print(
            "\ninterrupted: finished results are in the output; run the same command again "
            "to continue",
            file=sys.stderr,
        )
        return 130
    engine.close()
    retried = getattr(engine, "num_retried", 0)
    if retried:
        print(f"{retried} requests retried after a Ray actor died", file=sys.stderr)
    # multi-host: the other processes computed the same results and wrote nothing
    owner = "" if jax.process_index() == 0 else "process 0's "
    print(
        f"{stats.done} results written to {owner}{args.output}, {stats.errors} errors "
        f"(see {owner}{errors_path}), {stats.skipped} done before; {stats.output_tokens} output "
        f"tokens in {stats.seconds:.1f}s = {stats.output_tokens_per_second:,.0f} tok/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # during start-up: nothing was running yet
        sys.exit(130)
