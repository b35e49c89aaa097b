"""Which token buckets? Measure several bucket sets on one workload and recommend one.

Every bucket is one compiled step program: more buckets pad less (a step runs in the smallest
bucket that holds its tokens) but take longer to compile and more memory to keep. For each set
this builds a jaxcb engine (the persistent compilation cache off, so compiling is really
measured; a bucket two sets share counts its first compilation for both), serves the
workload, the sets taking turns pass by pass, and reports compile seconds, padding fraction,
output tok/s, and mean TTFT and inter-token latency (every request arrives at the start). It
prints a table, writes a bar chart PNG, and recommends the set that compiles fastest among
those within --tolerance of the best throughput.

Sets (--sets, comma list; M = max_num_batched_tokens, S = --smallest):
  pow2        S, 2S, 4S, ... M (jaxcb's default)
  geo1.5      S, then x1.5 each, rounded up to a multiple of 8, ... M
  stepK       K, 2K, 3K, ... M (fixed steps; plain "step" is K = max(S, M / 8))
  single      M alone: every step pays for the largest batch
  16/64/256   any explicit list (must end at M)

    python -m jaxcb.bench sweep_buckets                            # bench-57m, offline-mixed
    python -m jaxcb.bench sweep_buckets --sets pow2,single --num-requests 32 --png out/sweep.png
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
from jaxcb.bench.commands import SharedFlags, UsageError
from jaxcb.bench.offline_report import output_rate
from jaxcb.bench.plots import require_matplotlib
from jaxcb.bench.systems import BenchContext, JaxcbSystem, environment
from jaxcb.bench.workloads import Workload
from jaxcb.config import EngineConfig, flat_fields

DESCRIPTION = "several token-bucket sets on one workload: compile time, padding, tok/s; one pick"
FLAGS = SharedFlags(
    repeats=1,
    repeats_help="timed passes per set",
    model=True,
    default_model="bench-57m",
    dtype="float32",
    config=True,
)

log = make_log()
DEFAULT_SETS = "pow2,geo1.5,step,single"


def bucket_set(name: str, largest: int, smallest: int = 16) -> tuple[int, ...]:
    """The buckets a set name stands for, ending at `largest` (ValueError if unknown)."""
    smallest = min(smallest, largest)
    if name == "pow2":
        sizes, b = [], smallest
        while b < largest:
            sizes.append(b)
            b *= 2
    elif name.startswith("geo"):
        try:
            ratio = float(name[3:])
        except ValueError:
            raise ValueError(f"bucket set {name!r}: geoR wants a ratio, e.g. geo1.5") from None
        if ratio <= 1:
            raise ValueError(f"bucket set {name!r}: the ratio must be > 1")
        sizes, b = [], smallest
        while b < largest:
            sizes.append(b)
            b = max(b + 1, -(-int(b * ratio) // 8) * 8)
    elif name.startswith("step"):
        try:
            step = int(name[4:]) if name[4:] else max(smallest, largest // 8)
        except ValueError:
            raise ValueError(f"bucket set {name!r}: stepK wants an integer K") from None
        if step < 1:
            raise ValueError(f"bucket set {name!r}: the step must be >= 1")
        sizes = list(range(step, largest, step))
    elif name == "single":
        sizes = []
    elif "/" in name or name.isdigit():
        try:
            sizes = [int(x) for x in name.split("/") if x]
        except ValueError:
            raise ValueError(f"bucket set {name!r}: a list is sizes joined by '/'") from None
        if not sizes or sizes[-1] != largest:
            raise ValueError(f"bucket set {name!r} must end at max_num_batched_tokens={largest}")
        sizes = sizes[:-1]
    else:
        raise ValueError(
            f"unknown bucket set {name!r}: pow2, geoR, step, stepK, single or a list like 16/64/256"
        )
    return (*sorted({b for b in sizes if 1 <= b < largest}), largest)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, default_workload="offline-mixed")
    parser.add_argument("--sets", default=DEFAULT_SETS, help="bucket sets (%(default)s)")
    parser.add_argument(
        "--smallest", type=int, default=16, help="smallest bucket of generated sets (16)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="throughput within this fraction of the best counts as tied (%(default)s)",
    )
    parser.add_argument(
        "--png", type=Path, default=Path("sweep_buckets.png"), help="plot (%(default)s)"
    )
    add_config_overrides(parser, skip=("model", "dtype", "token_buckets"))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.sets = [s for s in args.sets.split(",") if s]
    if len(set(args.sets)) != len(args.sets) or not args.sets:
        parser.error(f"--sets must name distinct sets, got {args.sets}")
    if args.smallest < 1 or not 0 <= args.tolerance < 1:
        parser.error("--smallest must be >= 1, --tolerance in [0, 1)")
    try:  # before the passes: they end in a plot
        require_matplotlib()
    except ImportError as exc:
        parser.error(str(exc))


def recommend(rows: list[dict[str, Any]], tolerance: float) -> tuple[dict[str, Any], str]:
    """The set compiling fastest among those within `tolerance` of the best throughput."""
    best = max(r["output_tok_s"] for r in rows)
    tied = [r for r in rows if r["output_tok_s"] >= (1 - tolerance) * best]
    pick = min(tied, key=lambda r: (r["compile_seconds"], -r["output_tok_s"]))
    why = (
        f"{pick['name']} {list(pick['buckets'])}: {pick['output_tok_s']:,.0f} output tok/s, "
        f"within {tolerance:.0%} of the best ({best:,.0f}), and the fastest to compile of the "
        f"{len(tied)} that are ({pick['compile_seconds']:.1f}s)"
    )
    return pick, why


def print_table(rows: list[dict[str, Any]], workload: Workload) -> None:
    print(
        f"\n{workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens:,} "
        f"prompt + {workload.output_tokens:,} output tokens, all arriving at once"
    )
    head = (
        f"{'set':<10}{'buckets':<34}{'compile s':>10}{'pad frac':>10}{'out tok/s':>11}"
        f"{'mean TTFT ms':>14}{'mean ITL ms':>13}{'steps':>7}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        buckets = ",".join(map(str, r["buckets"]))
        if len(buckets) > 32:
            buckets = buckets[:29] + "..."
        print(
            f"{r['name']:<10}{buckets:<34}{r['compile_seconds']:>10.1f}"
            f"{r['padding_fraction']:>10.1%}{r['output_tok_s']:>11,.0f}{r['mean_ttft_ms']:>14,.0f}"
            f"{r['mean_itl_ms']:>13.1f}{r['steps']:>7}"
        )


def run_sets(
    args: argparse.Namespace,
    sets: dict[str, tuple[int, ...]],
    overrides: dict[str, Any],
    model_dir: Path,
    workload: Workload,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Build a jaxcb engine per bucket set, then time --repeats passes of each, the sets
    taking turns; returns each set's `info()` and its passes' records."""
    systems: dict[str, JaxcbSystem] = {}
    passes: dict[str, list[dict]] = {n: [] for n in sets}
    try:
        for name, buckets in sets.items():
            log(f"building jaxcb with buckets {list(buckets)} ({name}) ...")
            ctx = BenchContext(
                model_dir=model_dir,
                workload=workload,
                dtype=args.dtype,
                log=log,
                jaxcb_config=args.config,
                jaxcb_overrides=overrides | dict(token_buckets=list(buckets)),
                warmup_requests=args.warmup_requests,
            )
            start = time.perf_counter()
            systems[name] = JaxcbSystem(ctx)
            log(f"built in {time.perf_counter() - start:.1f}s")
        for round_ in range(args.repeats):
            for name, system in systems.items():
                log(f"pass {round_ + 1}/{args.repeats} of {name} ...")
                result = system.run_pass()
                out = sum(map(len, result.token_ids))
                passes[name].append(dict(wall_s=result.wall_s, output_tokens=out, **result.extra))
                log(f"{name}: {result.wall_s:.1f}s")
        infos = {n: s.info() for n, s in systems.items()}
    finally:
        for system in systems.values():
            system.close()
    return infos, passes


def set_rows(
    sets: dict[str, tuple[int, ...]],
    infos: dict[str, dict[str, Any]],
    passes: dict[str, list[dict[str, Any]]],
    workload: Workload,
) -> list[dict[str, Any]]:
    """One row per set: its compile seconds, padding, steps, and median throughput/latency."""
    # A bucket shared by two sets compiles once per process (jax keeps the executable), so
    # the second set would look free: a set's compile time is the sum of its buckets' first,
    # real compilations.
    per_bucket: dict[int, float] = {}
    for info in infos.values():
        for b, seconds in info["compile_seconds_per_bucket"].items():
            per_bucket[int(b)] = max(per_bucket.get(int(b), 0.0), seconds)
    rows = []
    for name, buckets in sets.items():
        wall = statistics.median(p["wall_s"] for p in passes[name])
        rows.append(
            dict(
                name=name,
                buckets=list(buckets),
                compile_seconds=sum(per_bucket[b] for b in buckets),
                padding_fraction=passes[name][-1]["padding_fraction"],
                steps=passes[name][-1]["steps"],
                wall_s=wall,
                output_tok_s=output_rate(passes[name]),
                mean_ttft_ms=1e3 * statistics.median(p["mean_ttft_s"] for p in passes[name]),
                mean_itl_ms=1e3 * statistics.median(p["mean_itl_s"] for p in passes[name]),
            )
        )
    return rows


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    model_dir, _, workload = load_model_and_workload(args)
    # The preset's buckets are replaced by each set's (and must not clash with the flags).
    overrides = config_overrides(args, workload.max_seq_len, log, base=dict(token_buckets=None))
    if "compilation_cache" in flat_fields() and args.cfg_compilation_cache is None:
        overrides["compilation_cache"] = "off"  # measure compiling, not a cache hit
    largest = EngineConfig.from_yaml(args.config, **overrides).scheduler.max_num_batched_tokens
    try:  # (the sets end at max_num_batched_tokens: known once the preset is read)
        sets = {name: bucket_set(name, largest, args.smallest) for name in args.sets}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    log(f"model {model_dir}; workload {workload.name}; sets {sets}")

    infos, passes = run_sets(args, sets, overrides, model_dir, workload)
    rows = set_rows(sets, infos, passes, workload)
    print_table(rows, workload)
    pick, why = recommend(rows, args.tolerance)
    print(f"recommended: {why}")
    from jaxcb.bench.plots import plot_sweep

    plot_sweep(rows, args.png, title=f"{model_dir.name}, {workload.name}, {args.dtype}")
    log(f"wrote {args.png}")
    record |= dict(
        workload=workload.summary(),
        sets={n: dict(info=infos[n], passes=passes[n]) for n in sets},
        results=rows,
        recommended=pick["name"],
        environment=environment(),
    )
