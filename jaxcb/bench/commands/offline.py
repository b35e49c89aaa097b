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
             per pass (off with --prefix-caching off); --vllm-binding tuned (default) binds
             its OpenMP threads to cores 0-1 with the venv's libiomp5.so preloaded
  llama.cpp  llama-server (--llamacpp-server) with --llamacpp-np parallel slots and continuous
             batching on a GGUF file of the same weights (--llamacpp-gguf; smollm2-135m's
             F32/BF16 files follow --dtype, q4_1 is the original file), every request of a
             pass sent at once over HTTP (jaxcb/bench/llamacpp_system.py); extra files in
             --llamacpp-gguf become extra rows (llama.cpp-q4_1)
Default: every system (vllm only with --vllm-python, llama.cpp only with --llamacpp-server).

Model: bench-57m (Llama, seeded random weights, built once in $JAXCB_CACHE_DIR or
~/.cache/jaxcb), smollm2-135m (the real model, SmolLM2-135M-Instruct dequantized from its
GGUF file, with configs/bench-smollm2-cpu.yaml), or --model DIR for any Hugging Face model
directory. Workloads: offline-mixed, offline-long, shared-prefix (random token ids, EOS
ignored); chat-natural, chat-fixed (real chat requests, greedy to the end of the turn or to
fixed lengths; they need a chat model such as smollm2-135m). Output tok/s counts the tokens
each system generated (the same for every system when EOS is ignored).

Every jaxcb config field can be overridden as a flag (--max-num-seqs 64, --token-buckets
16,32,64, --batching static, ...; listed below); --dtype applies to every system. The report
gives each system's output and total tok/s, jaxcb's speed over each, useful GFLOP/s and model
FLOPs utilisation against a matmul peak measured here on the model's own shapes, and jaxcb's
padding fraction, steps and compile seconds. The machine is shared and noisy: compare the
ratios of one run, not absolute numbers across runs.

    python -m jaxcb.bench offline                               # jaxcb, hf-cb, hf-static
    python -m jaxcb.bench offline --vllm-python /work/vllm-venv/bin/python --dtype bfloat16
    python -m jaxcb.bench offline --systems jaxcb --dtype bfloat16 --repeats 5
    python -m jaxcb.bench offline --num-requests 16 --json out/offline.json
    python -m jaxcb.bench offline --workload shared-prefix --systems jaxcb,vllm --vllm-python ..
    python -m jaxcb.bench offline --systems jaxcb --trace out/trace.json   # then plot_trace
    python -m jaxcb.bench offline --workload shared-prefix --systems jaxcb --prefix-caching both
    python -m jaxcb.bench offline --model smollm2-135m --workload chat-fixed --prefix-caching \
        off --vllm-python .. --llamacpp-server ../build/bin/llama-server --llamacpp-gguf f32,q4_1

--variant NAME:FIELD=V,FIELD=V (repeatable) adds a row `jaxcb-NAME`: jaxcb with those config
fields changed, taking turns with jaxcb; its greedy tokens are checked against jaxcb's. To
compare preemption by recompute and by swap under memory pressure, for instance:

    python -m jaxcb.bench offline --model smollm2-135m --workload offline-long \
        --systems jaxcb --num-pages 544 --preemption-mode recompute \
        --variant swap:preemption_mode=swap --variant auto:preemption_mode=auto

--prefix-caching both runs jaxcb twice, taking turns: `jaxcb` with the prefix cache and
`jaxcb-no-prefix-cache` without, and reports the mean TTFT and tok/s ratios of the two.

A system is a class in jaxcb/bench/ registered in the SYSTEMS table of jaxcb/bench/systems.py;
the rows are built and take their turns in jaxcb/bench/offline_systems.py, the report is
printed by jaxcb/bench/offline_report.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxcb.bench.cli import (
    add_config_overrides,
    add_llamacpp_args,
    add_workload_args,
    config_overrides,
    llamacpp_context,
    llamacpp_ggufs,
    load_model_and_workload,
    make_log,
)
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.offline_report import (
    compare_prefix_caching,
    cross_check,
    paired_ratios,
    print_report,
    summarize,
)
from jaxcb.bench.offline_systems import build_systems, parse_variant, take_turns
from jaxcb.bench.roofline import measure_matmul_peak, model_matmul_shapes, workload_flops
from jaxcb.bench.systems import SYSTEMS, BenchContext, environment
from jaxcb.config import EngineConfig
from jaxcb.engine.step_trace import save_trace
from jaxcb.models.registry import num_params

DESCRIPTION = "offline throughput: jaxcb against HF transformers, vLLM and llama.cpp"
FLAGS = SharedFlags(
    repeats=3,
    repeats_help="timed passes of jaxcb and vllm",
    model=True,
    default_model="bench-57m",
    dtype="float32",
    config=True,
)

log = make_log()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, default_workload="offline-mixed", jaxcb_model=True)
    add_system_args(parser)
    add_llamacpp_args(parser)
    add_output_args(parser)
    add_config_overrides(parser)


def add_system_args(parser: argparse.ArgumentParser) -> None:
    """Which systems run, how many timed passes each HF one, and the HF and vLLM systems'
    knobs."""
    parser.add_argument(
        "--systems",
        help=f"comma list, in turn order, from {list(SYSTEMS)} (default: all; vllm only "
        "with --vllm-python)",
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


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """jaxcb's prefix cache and variants, the roofline, and where the step trace goes."""
    parser.add_argument(
        "--prefix-caching",
        choices=["on", "off", "both"],
        default="on",
        help="jaxcb's prefix cache; both: also run jaxcb without it, as jaxcb-no-prefix-cache, "
        "and compare mean TTFT and tok/s (%(default)s)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:FIELD=V[,FIELD=V]",
        help="another jaxcb row, jaxcb-NAME, with these config fields changed (repeatable)",
    )
    parser.add_argument(
        "--no-roofline", action="store_true", help="skip measuring the matmul peak (no MFU)"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help="write jaxcb's step trace of its last pass here (JSON; the plot_trace benchmark "
        "draws it)",
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turn --systems into a list and reject flag combinations that cannot run (--repeats is
    checked by the entry point)."""
    if args.systems is None:
        wanted = dict(vllm=args.vllm_python, **{"llama.cpp": args.llamacpp_server})
        args.systems = [n for n in SYSTEMS if wanted.get(n, True)]
    else:
        args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"unknown --systems {unknown}; choose from {list(SYSTEMS)}")
    if "vllm" in args.systems and args.vllm_python is None:
        parser.error("the vllm system needs --vllm-python (see shared/BENCHMARKS.md)")
    if args.vllm_python is not None and not args.vllm_python.exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist")
    if "llama.cpp" in args.systems and args.llamacpp_server is None:
        parser.error("the llama.cpp system needs --llamacpp-server (see docs/benchmarks.md)")
    args.llamacpp_ggufs = llamacpp_ggufs(args)
    if args.variant and "jaxcb" not in args.systems:
        parser.error("--variant adds jaxcb rows: add jaxcb to --systems")
    for text in args.variant:
        try:
            parse_variant(text)
        except ValueError as exc:
            parser.error(str(exc))
    if args.trace and "jaxcb" not in args.systems:
        parser.error("--trace records jaxcb's steps: add jaxcb to --systems")
    if min(args.hf_repeats, args.hf_static_batch_size) < 1:
        parser.error("--hf-repeats and --hf-static-batch-size must be >= 1")


def make_context(args: argparse.Namespace, model_dir: Path, workload) -> BenchContext:
    """What every system is built from: the flags, with jaxcb's config overrides (and a
    max_model_len that fits the workload)."""
    hf_cb = dict(
        max_batch_tokens=args.hf_cb_max_batch_tokens,
        num_blocks=args.hf_cb_num_blocks,
        page_size=args.hf_cb_page_size,
    )
    return BenchContext(
        model_dir=model_dir,
        jaxcb_model=args.jaxcb_model,
        workload=workload,
        dtype=args.dtype,
        log=log,
        jaxcb_config=args.config,
        jaxcb_overrides=config_overrides(args, workload.max_seq_len, log),
        warmup_requests=args.warmup_requests,
        hf_static_batch_size=args.hf_static_batch_size,
        hf_cb_options={k: v for k, v in hf_cb.items() if v is not None},
        vllm_python=args.vllm_python,
        vllm_binding=args.vllm_binding,
        record_trace=args.trace is not None,
        prefix_caching=args.prefix_caching != "off",
        **llamacpp_context(args),
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


def system_flops(spec, workload, result) -> float:
    """Useful FLOPs of a system's pass, from the output lengths it really generated."""
    return workload_flops(spec, workload, [len(t) for t in result.token_ids])["total"]


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
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
        build_systems(
            args.systems,
            ctx,
            systems,
            ggufs=args.llamacpp_ggufs,
            variants=args.variant,
            prefix_cache_both=args.prefix_caching == "both",
            config=args.config,
        )
        repeats = {n: args.hf_repeats if n.startswith("hf-") else args.repeats for n in systems}
        passes, last = take_turns(systems, repeats, log)
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
    rows = [
        summarize(n, passes[n], workload, system_flops(spec, workload, last[n]), peak)
        for n in systems
    ]
    paired_ratios(rows)
    print_report(rows, infos, last, workload, peak)
    agree = cross_check(last)
    prefix_caching = compare_prefix_caching(passes, workload)

    record |= dict(
        model=dict(dir=str(model_dir), params=num_params(spec)),
        workload=workload.summary(),
        useful_flops=flops,
        roofline=roofline,
        systems={n: dict(info=infos[n], passes=passes[n]) for n in systems},
        medians=rows,
        agreement_with_jaxcb=agree,
        prefix_caching=prefix_caching,
        environment=environment(),
    )
