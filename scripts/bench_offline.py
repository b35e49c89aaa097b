"""Offline throughput: jaxcb against Hugging Face transformers on the same weights and requests.

Serves one workload of shared/BENCHMARKS.md (token-id prompts, greedy, EOS ignored, each
request its own max_tokens) with every chosen system, in one process, the systems taking turns
pass by pass, and compares medians. Wall time covers serving the whole workload after an
untimed warm-up; output tok/s counts each request's max_tokens, total tok/s adds the prompts.

Systems (--systems):
  jaxcb      jaxcb.LLM(model, config=--config, **overrides).generate(...); compiling happens
             when the engine is built and is reported, never timed
  hf-cb      transformers' ContinuousBatchingManager, add_request(..., max_new_tokens=m) per
             request; a fresh manager per pass, warmed up with a few requests first
  hf-static  transformers' model.generate on left-padded batches of --hf-static-batch-size in
             arrival order, each batch run to its longest max_tokens (the padding waste is the
             point: it is reported as raw generated tokens)

Model: bench-57m (Llama, seeded random weights, built once in $JAXCB_CACHE_DIR or
~/.cache/jaxcb), or --model DIR for any Hugging Face model directory.

Every jaxcb config field can be overridden as a flag (--max-num-seqs 64, --token-buckets
16,32,64, ...; listed below); --dtype applies to every system. The machine is shared and
noisy: compare the ratios of one run, not absolute numbers across runs.

    python scripts/bench_offline.py                               # the full default comparison
    python scripts/bench_offline.py --systems jaxcb --dtype bfloat16 --repeats 5
    python scripts/bench_offline.py --num-requests 16 --json out/bench_offline.json
    python scripts/bench_offline.py --workload offline-long --systems jaxcb,hf-cb

A system is a class in jaxcb/bench/systems.py registered in its SYSTEMS table (issue 7 adds
vLLM there, run as a subprocess in its own venv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import jaxcb  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxcb.bench.models import bench_model_dir
from jaxcb.bench.roofline import measure_matmul_peak, model_matmul_shapes, workload_flops
from jaxcb.bench.systems import SYSTEMS, BenchContext, environment
from jaxcb.bench.workloads import WORKLOADS, make_workload
from jaxcb.config import EngineConfig, flat_fields
from jaxcb.models.weights import read_hf_config, spec_from_hf_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "bench-cpu.yaml"
#: Config fields the script sets itself (or has its own flag for).
OWN_FIELDS = ("model", "dtype")
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="Hugging Face model dir (default: bench-57m)")
    parser.add_argument(
        "--workload",
        default="offline-mixed",
        choices=sorted(WORKLOADS),
        help="; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()),
    )
    parser.add_argument(
        "--num-requests", type=int, help="serve only the first N requests (quick runs)"
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma list, in turn order, from {list(SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights/activations of every system (%(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed passes of jaxcb, median reported (%(default)s)",
    )
    parser.add_argument(
        "--hf-repeats", type=int, default=1, help="timed passes of each HF system (%(default)s)"
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=4,
        help="first N requests served untimed by each system before timing (%(default)s)",
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="jaxcb YAML preset (%(default)s)"
    )
    parser.add_argument(
        "--hf-static-batch-size", type=int, default=8, help="hf-static batch size (%(default)s)"
    )
    parser.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        help="ContinuousBatchingConfig.max_batch_tokens (default: transformers' choice)",
    )
    parser.add_argument(
        "--hf-cb-num-blocks",
        type=int,
        help="KV blocks of HF-CB (default: room for every request at once)",
    )
    parser.add_argument("--hf-cb-page-size", type=int, help="tokens per HF-CB block (256)")
    parser.add_argument(
        "--torch-threads", type=int, help="torch.set_num_threads (default: torch's choice)"
    )
    parser.add_argument(
        "--no-roofline", action="store_true", help="skip measuring the matmul peak (no MFU)"
    )
    parser.add_argument("--json", type=Path, help="write config, per-pass times, medians here")
    group = parser.add_argument_group(
        "jaxcb config overrides", "any EngineConfig field; given ones replace the preset's"
    )
    for name, (section, f) in flat_fields().items():
        if name not in OWN_FIELDS:
            kind = (
                str(f.type).replace("tuple[int, ...]", "comma list of int").replace(" | None", "")
            )
            group.add_argument(
                f"--{name.replace('_', '-')}",
                dest=f"cfg_{name}",
                metavar="V",
                help=f"{section or 'engine'}.{name} ({kind})",
            )
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"unknown --systems {unknown}; choose from {list(SYSTEMS)}")
    if min(args.repeats, args.hf_repeats, args.hf_static_batch_size) < 1:
        parser.error("--repeats, --hf-repeats and --hf-static-batch-size must be >= 1")
    return args


def jaxcb_overrides(args: argparse.Namespace, needed_len: int) -> dict[str, Any]:
    """Flat config overrides from the flags, plus a max_model_len that fits the workload."""
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    overrides["dtype"] = args.dtype
    config = EngineConfig.from_yaml(args.config, **overrides)  # fails early on a bad value
    if config.max_model_len is not None and config.max_model_len < needed_len:
        page = config.cache.page_size
        overrides["max_model_len"] = -(-needed_len // page) * page
        log(
            f"max_model_len {config.max_model_len} < {needed_len} the workload needs: using "
            f"{overrides['max_model_len']} (pass --max-model-len to choose)"
        )
    return overrides


def summarize(name: str, passes: list[dict], workload, flops: float, peak: float | None) -> dict:
    """Medians of one system's passes."""
    wall = statistics.median(p["wall_s"] for p in passes)
    out = dict(
        system=name,
        passes=len(passes),
        wall_s=wall,
        wall_s_all=[p["wall_s"] for p in passes],
        output_tok_s=workload.output_tokens / wall,
        total_tok_s=(workload.output_tokens + workload.prompt_tokens) / wall,
        useful_gflop_s=flops / wall / 1e9,
    )
    out["mfu"] = out["useful_gflop_s"] / peak if peak else None
    return out


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """How closely two systems' greedy tokens agree, request by request."""
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    prefix = []
    for a, b in zip(reference, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        prefix.append(n / max(len(a), 1))
    return dict(
        identical_fraction=same / len(reference), mean_prefix_fraction=statistics.mean(prefix)
    )


def print_report(rows: list[dict], infos: dict, last: dict, workload, peak) -> None:
    base = next((r for r in rows if r["system"] == "jaxcb"), None)
    print(
        f"\n{workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens:,} "
        f"prompt + {workload.output_tokens:,} output tokens"
    )
    head = f"{'system':<11}{'passes':>7}{'wall s':>9}{'out tok/s':>11}{'total tok/s':>13}"
    head += f"{'jaxcb x':>9}{'GFLOP/s':>9}{'MFU':>7}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ratio = f"{base['output_tok_s'] / r['output_tok_s']:.2f}" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{r['system']:<11}{r['passes']:>7}{r['wall_s']:>9.1f}{r['output_tok_s']:>11,.0f}"
            f"{r['total_tok_s']:>13,.0f}{ratio:>9}{r['useful_gflop_s']:>9.1f}{mfu:>7}"
        )
    print("(jaxcb x = jaxcb's output tok/s over the row's; GFLOP/s counts useful work only)")
    if peak:
        print(f"matmul peak on the model's shapes (best of before/after): {peak:.0f} GFLOP/s")
    if "jaxcb" in last:
        e = last["jaxcb"].extra
        print(
            f"jaxcb: compile {infos['jaxcb']['compile_seconds']:.1f}s, padding fraction "
            f"{e['padding_fraction']:.3f}, steps {e['steps']}, preemptions {e['preemptions']}, "
            f"host {e['host_seconds']:.2f}s vs device {e['device_seconds']:.2f}s, "
            f"buckets {e['bucket_histogram']}"
        )
    if "hf-static" in last:
        raw = last["hf-static"].extra["raw_generated_tokens"]
        print(
            f"hf-static: {raw:,} tokens generated for {workload.output_tokens:,} useful "
            f"({1 - workload.output_tokens / raw:.1%} wasted on batch padding)"
        )


def cross_check(last: dict) -> dict[str, dict[str, float]]:
    """Greedy token agreement of every system with jaxcb, printed (a report, not a test)."""
    if "jaxcb" not in last:
        return {}
    agree = {}
    for name in (n for n in last if n != "jaxcb"):
        agree[name] = agreement(last["jaxcb"].token_ids, last[name].token_ids)
        print(
            f"greedy agreement jaxcb vs {name}: {agree[name]['identical_fraction']:.1%} of "
            f"requests identical, mean matching prefix {agree[name]['mean_prefix_fraction']:.1%}"
        )
    distinct = statistics.mean(len(set(t)) / len(t) for t in last["jaxcb"].token_ids)
    print(
        f"(distinct tokens per jaxcb output: {distinct:.0%} of its length on average; "
        "random weights tend to repeat tokens, which makes agreement easier)"
    )
    return agree


def make_context(args: argparse.Namespace, model_dir: Path, workload) -> BenchContext:
    hf_cb = dict(
        max_batch_tokens=args.hf_cb_max_batch_tokens,
        num_blocks=args.hf_cb_num_blocks,
        page_size=args.hf_cb_page_size,
    )
    return BenchContext(
        model_dir=model_dir,
        workload=workload,
        dtype=args.dtype,
        log=log,
        jaxcb_config=args.config,
        jaxcb_overrides=jaxcb_overrides(args, workload.max_seq_len),
        warmup_requests=args.warmup_requests,
        hf_static_batch_size=args.hf_static_batch_size,
        hf_cb_options={k: v for k, v in hf_cb.items() if v is not None},
    )


def measure_roofline(args: argparse.Namespace, spec, overrides: dict, before=None) -> dict | None:
    """The matmul peak on the shapes of jaxcb's largest bucket (None with --no-roofline).

    Measured before and again after the passes (`before` is the first result): a neighbour's
    load halves it for a while, so the better of the two is the machine's figure.
    """
    if args.no_roofline:
        return None
    sched = EngineConfig.from_yaml(args.config, **overrides).scheduler
    shapes = model_matmul_shapes(spec, sched.max_num_batched_tokens, sched.max_num_seqs)
    roofline = measure_matmul_peak(shapes, args.dtype)
    log(f"matmul peak ({args.dtype}, f32 accumulation): {roofline['best_gflops']:.0f} GFLOP/s")
    if before is not None:
        roofline = dict(before=before, after=roofline)
        roofline["best_gflops"] = max(before["best_gflops"], roofline["after"]["best_gflops"])
    return roofline


def take_turns(systems: dict, repeats: dict[str, int], workload) -> tuple[dict, dict]:
    """Round-robin passes; returns every pass's record and each system's last PassResult."""
    passes: dict[str, list[dict]] = {n: [] for n in systems}
    last = {}
    for round_ in range(max(repeats.values())):
        for name, system in systems.items():
            if round_ >= repeats[name]:
                continue
            log(f"pass {round_ + 1}/{repeats[name]} of {name} ...")
            load = os.getloadavg()[0]  # a busy machine explains a slow pass
            result = last[name] = system.run_pass()
            passes[name].append(dict(wall_s=result.wall_s, load_avg=load, **result.extra))
            tok_s = workload.output_tokens / result.wall_s
            log(f"{name}: {result.wall_s:.1f}s, {tok_s:,.0f} output tok/s")
    return passes, last


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    model_dir = Path(args.model or bench_model_dir("bench-57m"))
    spec = spec_from_hf_config(read_hf_config(model_dir))
    workload = make_workload(
        args.workload, num_requests=args.num_requests, vocab_size=spec.vocab_size
    )
    checked = workload.is_complete and workload.spec.expected_totals  # else make_workload raised
    log(
        f"model {model_dir}; workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.prompt_tokens:,} prompt + {workload.output_tokens:,} output tokens"
        + (" (as BENCHMARKS.md says)" if checked else "")
    )
    flops = workload_flops(spec, workload)
    ctx = make_context(args, model_dir, workload)
    roofline = measure_roofline(args, spec, ctx.jaxcb_overrides)

    systems = {}
    try:
        for name in args.systems:
            log(f"building {name} ...")
            start = time.perf_counter()
            systems[name] = SYSTEMS[name](ctx)
            log(f"built {name} in {time.perf_counter() - start:.1f}s")
        repeats = {n: args.hf_repeats if n.startswith("hf-") else args.repeats for n in systems}
        passes, last = take_turns(systems, repeats, workload)
        infos = {n: s.info() for n, s in systems.items()}
    finally:
        for system in systems.values():
            system.close()
    roofline = measure_roofline(args, spec, ctx.jaxcb_overrides, before=roofline)
    peak = roofline["best_gflops"] if roofline else None
    rows = [summarize(n, passes[n], workload, flops["total"], peak) for n in systems]
    print_report(rows, infos, last, workload, peak)
    agree = cross_check(last)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        cli = {k: v for k, v in vars(args).items() if not (k.startswith("cfg_") and v is None)}
        record = dict(
            args={k: str(v) if isinstance(v, Path) else v for k, v in cli.items()},
            model=dict(dir=str(model_dir), params=spec.num_params()),
            workload=workload.summary(),
            useful_flops=flops,
            roofline=roofline,
            systems={n: dict(info=infos[n], passes=passes[n]) for n in systems},
            medians=rows,
            agreement_with_jaxcb=agree,
            environment=environment(),
        )
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
