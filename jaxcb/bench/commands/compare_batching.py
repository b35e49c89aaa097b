"""Static vs dynamic vs continuous batching, all three on jaxcb's own engine, one workload.

The classic result, reproduced with the same model, kernels, buckets and KV pool, only the
scheduler changed (`--batching`, see jaxcb/engine/sched/baselines.py):

  static      a padded batch of up to max_num_seqs requests, prompts left-padded to the
              longest; it runs until its slowest request is done (finished rows stay as
              padding), and only then is the next batch formed
  dynamic     a padded batch whose finished rows are refilled from the queue; a new request's
              n-token prompt is prefilled inside the batch, so each of the B - 1 running rows
              pads n - 1 slots: (n - 1)(B - 1) padding per refill
  continuous  the real engine: ragged token-budget steps, decodes first, chunked prefill

The modes take turns pass by pass (medians over --repeats). The table gives throughput, the
speed-up over static, padding token slots (the padded batch's own padding plus the bucket's
rounding up) and their fraction of all slots, steps, and mean time to first token (every
request arrives at the start, so TTFT includes queueing: static batching's weakness). The
greedy tokens of the three modes are compared (they must be identical), and a bar chart PNG
is written.

    python -m jaxcb.bench compare_batching                      # bench-57m, offline-mixed
    python -m jaxcb.bench compare_batching --num-requests 32 --png out/batching.png
    python -m jaxcb.bench compare_batching --trace-dir out/traces   # + a step trace per mode
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from jaxcb.bench.cli import (
    add_config_overrides,
    add_workload_args,
    config_overrides,
    load_model_and_workload,
    make_log,
)
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.offline_report import output_rate
from jaxcb.bench.plots import require_matplotlib
from jaxcb.bench.systems import BenchContext, JaxcbSystem, environment
from jaxcb.config import BATCHING_MODES
from jaxcb.engine.step_trace import save_trace

DESCRIPTION = "static vs dynamic vs continuous batching on jaxcb's own engine, one workload"
FLAGS = SharedFlags(
    repeats=1,
    repeats_help="timed passes per mode",
    model=True,
    default_model="bench-57m",
    dtype="float32",
    config=True,
)

log = make_log()
ORDER = ("static", "dynamic", "continuous")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, default_workload="offline-mixed")
    parser.add_argument(
        "--modes", default=",".join(ORDER), help="comma list of batching modes (%(default)s)"
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=Path("compare_batching.png"),
        help="bar chart to write (%(default)s)",
    )
    parser.add_argument(
        "--trace-dir", type=Path, help="write each mode's step trace (JSON and PNG) here"
    )
    add_config_overrides(parser, skip=("model", "dtype", "batching"))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in BATCHING_MODES]
    if bad or not args.modes:
        parser.error(f"unknown --modes {bad}; choose from {list(BATCHING_MODES)}")
    try:  # before the passes: they end in a plot
        require_matplotlib()
    except ImportError as exc:
        parser.error(str(exc))


def summarize(mode: str, passes: list[dict], workload) -> dict[str, Any]:
    """Medians over a mode's passes (the counts are the same in every pass)."""
    wall = statistics.median(p["wall_s"] for p in passes)
    last = passes[-1]
    return dict(
        batching=mode,
        passes=len(passes),
        wall_s=wall,
        output_tok_s=output_rate(passes),
        total_tok_s=output_rate(passes, workload.prompt_tokens),
        padding_tokens=last["token_slots"] - last["tokens_scheduled"],
        batch_padding_tokens=last["batch_padding_tokens"],
        padding_fraction=last["padding_fraction"],
        steps=last["steps"],
        mean_ttft_s=statistics.median(p["mean_ttft_s"] for p in passes),
        mean_itl_s=statistics.median(p["mean_itl_s"] for p in passes),
    )


def print_table(rows: list[dict], workload, same_tokens: bool) -> None:
    print(
        f"\n{workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens:,} "
        f"prompt + {workload.output_tokens:,} output tokens, all arriving at once"
    )
    head = (
        f"{'batching':<12}{'wall s':>8}{'out tok/s':>11}{'total tok/s':>13}{'x static':>10}"
        f"{'padding tok':>13}{'(batch)':>10}{'pad frac':>10}{'steps':>7}{'mean TTFT s':>13}"
    )
    print(head + "\n" + "-" * len(head))
    base = next((r for r in rows if r["batching"] == "static"), None)
    for r in rows:
        speedup = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base else "-"
        print(
            f"{r['batching']:<12}{r['wall_s']:>8.1f}{r['output_tok_s']:>11,.0f}"
            f"{r['total_tok_s']:>13,.0f}{speedup:>10}{r['padding_tokens']:>13,}"
            f"{r['batch_padding_tokens']:>10,}{r['padding_fraction']:>10.1%}{r['steps']:>7}"
            f"{r['mean_ttft_s']:>13.2f}"
        )
    print(
        "(padding tok: all padded token slots; (batch): those of the padded batch itself, the "
        "rest is the bucket's rounding up)"
    )
    print(f"greedy tokens identical across modes: {'yes' if same_tokens else 'NO'}")


def run(args: argparse.Namespace, record: dict[str, Any]) -> int:
    model_dir, _, workload = load_model_and_workload(args)
    log(
        f"model {model_dir}; workload {workload.name}: {len(workload.requests)} requests; "
        f"modes {args.modes}"
    )
    overrides = config_overrides(args, workload.max_seq_len, log)
    systems: dict[str, JaxcbSystem] = {}
    passes: dict[str, list[dict]] = {m: [] for m in args.modes}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for mode in args.modes:
            log(f"building jaxcb with batching={mode} ...")
            ctx = BenchContext(
                model_dir=model_dir,
                workload=workload,
                dtype=args.dtype,
                log=log,
                jaxcb_config=args.config,
                jaxcb_overrides=overrides | dict(batching=mode),
                warmup_requests=args.warmup_requests,
                record_trace=True,
            )
            start = time.perf_counter()
            systems[mode] = JaxcbSystem(ctx)
            log(f"built in {time.perf_counter() - start:.1f}s")
        for round_ in range(args.repeats):
            for mode, system in systems.items():
                log(f"pass {round_ + 1}/{args.repeats} of {mode} ...")
                result = system.run_pass()
                out = sum(map(len, result.token_ids))
                passes[mode].append(dict(wall_s=result.wall_s, output_tokens=out, **result.extra))
                tokens[mode] = result.token_ids
                log(f"{mode}: {result.wall_s:.1f}s")
        infos = {m: s.info() for m, s in systems.items()}
        if args.trace_dir:
            from jaxcb.bench.plots import plot_trace
            from jaxcb.engine.step_trace import load_trace

            for mode, system in systems.items():
                path = args.trace_dir / f"trace-{mode}.json"
                save_trace(
                    path, system.last_trace, system.trace_meta() | dict(workload=workload.name)
                )
                plot_trace(load_trace(path), path.with_suffix(".png"))
                log(f"wrote {path} and {path.with_suffix('.png')}")
    finally:
        for system in systems.values():
            system.close()

    rows = [summarize(m, passes[m], workload) for m in args.modes]
    reference = tokens[args.modes[-1]]
    same = all(tokens[m] == reference for m in args.modes)
    print_table(rows, workload, same)
    from jaxcb.bench.plots import plot_batching

    title = (
        f"{model_dir.name}, {workload.name} ({len(workload.requests)} requests), "
        f"max_num_seqs {infos[args.modes[0]]['config']['scheduler']['max_num_seqs']}, "
        f"{args.dtype}"
    )
    plot_batching(rows, args.png, title=title)
    log(f"wrote {args.png}")
    record |= dict(
        workload=workload.summary(),
        modes={m: dict(info=infos[m], passes=passes[m]) for m in args.modes},
        results=rows,
        greedy_tokens_identical=same,
        environment=environment(),
    )
    return 0 if same else 1
