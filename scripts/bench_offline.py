"""Offline throughput: jaxcb against HF transformers and vLLM on the same weights and requests.

Serves one workload of shared/BENCHMARKS.md (token-id prompts, greedy, EOS ignored, each
request its own max_tokens) with every chosen system, in one process, the systems taking turns
pass by pass, and compares medians. Wall time covers serving the whole workload after an
untimed warm-up; output tok/s counts each request's max_tokens, total tok/s adds the prompts.

Systems (--systems):
  jaxcb      jaxcb.LLM(model, config=--config, **overrides).generate(...); compiling happens
             when the engine is built and is reported, never timed; the prefix cache is
             emptied before every pass (every pass sends the same prompts)
  hf-cb      transformers' ContinuousBatchingManager, add_request(..., max_new_tokens=m) per
             request; a fresh manager per pass, warmed up with a few requests first
  hf-static  transformers' model.generate on left-padded batches of --hf-static-batch-size in
             arrival order, each batch run to its longest max_tokens (the padding waste is the
             point: it is reported as raw generated tokens)
  vllm       vLLM's CPU build in its own venv (--vllm-python, see shared/BENCHMARKS.md for the
             recipe), run by jaxcb/bench/vllm_runner.py in a subprocess: LLM(model,
             skip_tokenizer_init=True).generate on token-id prompts, its prefix cache reset
             per pass; --vllm-binding tuned (default) binds its OpenMP threads to cores 0-1
             with the venv's libiomp5.so preloaded
Default: every system (vllm only when --vllm-python is given).

Model: bench-57m (Llama, seeded random weights, built once in $JAXCB_CACHE_DIR or
~/.cache/jaxcb), or --model DIR for any Hugging Face model directory. Workloads:
offline-mixed, offline-long, shared-prefix (--workload).

Every jaxcb config field can be overridden as a flag (--max-num-seqs 64, --token-buckets
16,32,64, --batching static, ...; listed below); --dtype applies to every system. The report
gives each system's output and total tok/s, jaxcb's speed over each, useful GFLOP/s and model
FLOPs utilisation against a matmul peak measured here on the model's own shapes, and jaxcb's
padding fraction, steps and compile seconds. The machine is shared and noisy: compare the
ratios of one run, not absolute numbers across runs.

    python scripts/bench_offline.py                               # jaxcb, hf-cb, hf-static
    python scripts/bench_offline.py --vllm-python /work/vllm-venv/bin/python --dtype bfloat16
    python scripts/bench_offline.py --systems jaxcb --dtype bfloat16 --repeats 5
    python scripts/bench_offline.py --num-requests 16 --json out/bench_offline.json
    python scripts/bench_offline.py --workload shared-prefix --systems jaxcb,vllm --vllm-python ..
    python scripts/bench_offline.py --systems jaxcb --trace out/trace.json   # then plot_trace.py
    python scripts/bench_offline.py --workload shared-prefix --systems jaxcb --prefix-caching both

--prefix-caching both runs jaxcb twice, taking turns: `jaxcb` with the prefix cache and
`jaxcb-no-prefix-cache` without, and reports the mean TTFT and tok/s ratios of the two.

A system is a class in jaxcb/bench/systems.py registered in its SYSTEMS table.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from jaxcb.bench.cli import (
    add_config_overrides,
    add_workload_args,
    args_record,
    config_overrides,
    load_model_and_workload,
    make_log,
)
from jaxcb.bench.roofline import measure_matmul_peak, model_matmul_shapes, workload_flops
from jaxcb.bench.systems import SYSTEMS, BenchContext, environment
from jaxcb.bench.trace import save_trace
from jaxcb.config import EngineConfig

log = make_log()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser, default_workload="offline-mixed")
    parser.add_argument(
        "--systems",
        help=f"comma list, in turn order, from {list(SYSTEMS)} (default: all; vllm only "
        "with --vllm-python)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed passes of jaxcb and vllm, median reported (%(default)s)",
    )
    parser.add_argument(
        "--hf-repeats", type=int, default=1, help="timed passes of each HF system (%(default)s)"
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
        "--vllm-python",
        type=Path,
        help="python of vLLM's own venv (e.g. /work/vllm-venv/bin/python): adds the vllm system",
    )
    parser.add_argument(
        "--vllm-binding",
        default="tuned",
        choices=["tuned", "default"],
        help="tuned: VLLM_CPU_OMP_THREADS_BIND=0-1 + the venv's libiomp5.so (%(default)s)",
    )
    parser.add_argument(
        "--prefix-caching",
        choices=["on", "off", "both"],
        default="on",
        help="jaxcb's prefix cache; both: also run jaxcb without it, as jaxcb-no-prefix-cache, "
        "and compare mean TTFT and tok/s (%(default)s)",
    )
    parser.add_argument(
        "--no-roofline", action="store_true", help="skip measuring the matmul peak (no MFU)"
    )
    parser.add_argument("--json", type=Path, help="write config, per-pass times, medians here")
    parser.add_argument(
        "--trace",
        type=Path,
        help="write jaxcb's step trace of its last pass here (JSON; scripts/plot_trace.py)",
    )
    add_config_overrides(parser)
    args = parser.parse_args(argv)
    if args.systems is None:
        args.systems = [n for n in SYSTEMS if n != "vllm" or args.vllm_python]
    else:
        args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"unknown --systems {unknown}; choose from {list(SYSTEMS)}")
    if "vllm" in args.systems and args.vllm_python is None:
        parser.error("the vllm system needs --vllm-python (see shared/BENCHMARKS.md)")
    if args.vllm_python is not None and not args.vllm_python.exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist")
    if args.trace and "jaxcb" not in args.systems:
        parser.error("--trace records jaxcb's steps: add jaxcb to --systems")
    if min(args.repeats, args.hf_repeats, args.hf_static_batch_size) < 1:
        parser.error("--repeats, --hf-repeats and --hf-static-batch-size must be >= 1")
    return args


def jaxcb_overrides(args: argparse.Namespace, needed_len: int) -> dict[str, Any]:
    """Flat config overrides from the flags, plus a max_model_len that fits the workload."""
    return config_overrides(args, needed_len, log)


NO_PREFIX_CACHE = "jaxcb-no-prefix-cache"


def prefix_caching_systems(args: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    """--prefix-caching both: jaxcb without its prefix cache, to run beside jaxcb."""
    if args.prefix_caching != "both":
        return {}
    overrides = {**ctx.jaxcb_overrides, "enable_prefix_caching": False}
    log(f"building {NO_PREFIX_CACHE} ...")
    return {NO_PREFIX_CACHE: SYSTEMS["jaxcb"](dataclasses.replace(ctx, jaxcb_overrides=overrides))}


def compare_prefix_caching(passes: dict[str, list[dict]], workload) -> dict[str, float] | None:
    """Medians of jaxcb with and without the prefix cache, and their ratios, printed."""
    if NO_PREFIX_CACHE not in passes:
        return None
    on, off = passes["jaxcb"], passes[NO_PREFIX_CACHE]
    out = {}
    for key in ("mean_ttft_s", "wall_s"):
        out[f"{key}_on"] = statistics.median(p[key] for p in on)
        out[f"{key}_off"] = statistics.median(p[key] for p in off)
    out["ttft_reduction"] = out["mean_ttft_s_off"] / out["mean_ttft_s_on"]
    out["tok_s_ratio"] = out["wall_s_off"] / out["wall_s_on"]  # same tokens: 1 / wall time
    print(
        f"prefix caching on vs off: mean TTFT {out['mean_ttft_s_on']:.2f}s vs "
        f"{out['mean_ttft_s_off']:.2f}s ({out['ttft_reduction']:.1f}x lower); output tok/s "
        f"{workload.output_tokens / out['wall_s_on']:,.0f} vs "
        f"{workload.output_tokens / out['wall_s_off']:,.0f} ({out['tok_s_ratio']:.2f}x)"
    )
    return out


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


def paired_ratios(rows: list[dict]) -> None:
    """Add `paired_x` to each row: the median over rounds of (its pass time / jaxcb's pass time
    in the same round). Passes of one round ran back to back, so a neighbour's load shifts
    both alike: steadier than the ratio of medians when the load swings."""
    base = next((r for r in rows if r["system"] == "jaxcb"), None)
    for r in rows:
        pairs = list(zip(r["wall_s_all"], base["wall_s_all"], strict=False)) if base else []
        r["paired_x"] = statistics.median(a / b for a, b in pairs) if pairs else None


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
    head += f"{'jaxcb x':>9}{'paired x':>10}{'GFLOP/s':>9}{'MFU':>7}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ratio = f"{base['output_tok_s'] / r['output_tok_s']:.2f}" if base else "-"
        paired = f"{r['paired_x']:.2f}" if r.get("paired_x") is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{r['system']:<11}{r['passes']:>7}{r['wall_s']:>9.1f}{r['output_tok_s']:>11,.0f}"
            f"{r['total_tok_s']:>13,.0f}{ratio:>9}{paired:>10}{r['useful_gflop_s']:>9.1f}{mfu:>7}"
        )
    print(
        "(jaxcb x = jaxcb's output tok/s over the row's, from the medians; paired x = the "
        "median over rounds of the row's pass time over jaxcb's in the same round; GFLOP/s "
        "counts useful work only)"
    )
    if peak:
        print(f"matmul peak on the model's shapes (best of before/after): {peak:.0f} GFLOP/s")
    if "jaxcb" in last:
        e, cache = last["jaxcb"].extra, infos["jaxcb"].get("compile_cache") or {}
        cached = (
            f" ({cache['buckets_from_cache']} of "
            f"{cache['buckets_from_cache'] + cache['buckets_compiled']} buckets loaded from the "
            "compilation cache)"
            if cache.get("buckets_from_cache")
            else ""
        )
        print(
            f"jaxcb: compile {infos['jaxcb']['compile_seconds']:.1f}s{cached}, padding fraction "
            f"{e['padding_fraction']:.3f}, steps {e['steps']}, preemptions {e['preemptions']}, "
            f"host {e['host_seconds']:.2f}s vs device {e['device_seconds']:.2f}s, "
            f"buckets {e['bucket_histogram']}, batching "
            f"{infos['jaxcb']['config']['scheduler'].get('batching', 'continuous')}"
        )
    if "vllm" in infos:
        v = infos["vllm"]
        print(
            f"vllm: {v['version']}, binding {v['binding']}, load {v['load_seconds']:.0f}s "
            f"(untimed), {v['python']}"
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
        vllm_python=args.vllm_python,
        vllm_binding=args.vllm_binding,
        record_trace=args.trace is not None,
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
    model_dir, spec, workload = load_model_and_workload(args)
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
    if args.prefix_caching == "off":
        ctx.jaxcb_overrides["enable_prefix_caching"] = False
    try:
        for name in args.systems:
            log(f"building {name} ...")
            start = time.perf_counter()
            systems[name] = SYSTEMS[name](ctx)
            log(f"built {name} in {time.perf_counter() - start:.1f}s")
            if name == "jaxcb":
                systems |= prefix_caching_systems(args, ctx)
        repeats = {n: args.hf_repeats if n.startswith("hf-") else args.repeats for n in systems}
        passes, last = take_turns(systems, repeats, workload)
        infos = {n: s.info() for n, s in systems.items()}
        if args.trace:
            meta = systems["jaxcb"].trace_meta() | dict(workload=workload.name)
            save_trace(args.trace, systems["jaxcb"].last_trace, meta)
            log(f"wrote jaxcb's step trace to {args.trace}")
    finally:
        for system in systems.values():
            system.close()
    roofline = measure_roofline(args, spec, ctx.jaxcb_overrides, before=roofline)
    peak = roofline["best_gflops"] if roofline else None
    rows = [summarize(n, passes[n], workload, flops["total"], peak) for n in systems]
    paired_ratios(rows)
    print_report(rows, infos, last, workload, peak)
    agree = cross_check(last)
    prefix_caching = compare_prefix_caching(passes, workload)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = dict(
            args=args_record(args),
            model=dict(dir=str(model_dir), params=spec.num_params()),
            workload=workload.summary(),
            useful_flops=flops,
            roofline=roofline,
            systems={n: dict(info=infos[n], passes=passes[n]) for n in systems},
            medians=rows,
            agreement_with_jaxcb=agree,
            prefix_caching=prefix_caching,
            environment=environment(),
        )
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
