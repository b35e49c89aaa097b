"""Scheduling benchmarks (docs/scheduling.md): jaxcb in-process, one knob changed at a time.

Each study (order, admission, swap) serves one workload with every variant of its knob,
greedy with EOS ignored (every variant generates the very same number of tokens), and prints
a table with each variant's output tok/s and its ratio to the first variant, what the
scheduler did (prompt tokens computed, preemptions, recomputed and swapped requests) and
whether every request's tokens equal the first variant's.

  order      LLM.generate(order=arrival | auto | prefix) on one engine, prefix caching on:
             N passages x Q questions about each, shuffled (bench/passage_questions.py: real
             text through the chat template, or --source random). "prefill computed" is the
             prompt tokens the engine computed: looked up in the prefix cache minus found.
  admission  scheduler.admission = greedy | predicted | reserve, one engine each, on
             --workload (default chat-fixed: output lengths 16-256) with a KV pool of
             --pool-fraction (default 0.5) of the working set (every request's prompt +
             max_tokens): preemptions and recomputed tokens against throughput.
  swap       scheduler.preemption_mode = recompute | swap | auto, one engine each, on
             --workload (default offline-long: prompts of 512-1536 tokens) with a pool of
             --pool-fraction (default 0.25) of the working set and cache.swap_space_gb of host
             memory (the preset's, or --swap-space-gb).

    python -m jaxcb.bench scheduling order --json out/order.json
    python -m jaxcb.bench scheduling order --num-passages 32 --num-questions 6 \\
        --pool-fraction 0.3
    python -m jaxcb.bench scheduling admission --json out/admission.json
    python -m jaxcb.bench scheduling swap --variants recompute,swap --num-requests 16

Model: smollm2-135m (the real model, with configs/bench-smollm2-cpu.yaml) unless --model;
any EngineConfig field can be overridden (--max-num-seqs 64, --num-pages 2048, ...; a knob's
variant wins over its own flag). A pass starts with an empty prefix cache, after an untimed
warm-up of --warmup-requests on each engine. The machine is shared and noisy: compare the
ratios of one run. The engines of admission and swap are built one after another (their
passes do not alternate): jaxcb/bench/knob_passes.py.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from jaxcb.bench.cli import (
    DEFAULT_CONFIG,
    MODEL_CONFIGS,
    add_config_overrides,
    config_overrides,
    make_log,
    resolve_model,
)
from jaxcb.bench.commands import SharedFlags, UsageError
from jaxcb.bench.knob_passes import print_table, run_variants, summarize
from jaxcb.bench.passage_questions import SOURCES, passage_questions
from jaxcb.bench.workloads import WORKLOADS, Workload, make_workload
from jaxcb.config import EngineConfig

DESCRIPTION = "scheduling knobs one at a time: offline order, admission, preemption by swap"
FLAGS = SharedFlags(
    repeats=1,
    repeats_help="timed passes per variant",
    model=True,
    default_model="smollm2-135m",
    dtype="float32",
    config=True,
)

log = make_log()

#: study -> (the knob, its variants in turn order; the first is the baseline)
KNOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "order": ("order", ("arrival", "auto", "prefix")),
    "admission": ("admission", ("greedy", "predicted", "reserve")),
    "swap": ("preemption_mode", ("recompute", "swap", "auto")),
}
DEFAULT_WORKLOADS = {"admission": "chat-fixed", "swap": "offline-long"}
DEFAULT_POOL_FRACTION = {"order": None, "admission": 0.5, "swap": 0.25}
#: order's own flags and their defaults (its workload: passages and questions about each)
ORDER_DEFAULTS = dict(
    num_passages=16, num_questions=4, passage_tokens="256,1200", output_len="16,256", source="text"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "command",
        choices=list(KNOBS),
        help="the study: "
        + "; ".join(f"{name}: {knob} {' vs '.join(v)}" for name, (knob, v) in KNOBS.items()),
    )
    p.add_argument(
        "--variants",
        help="comma list, in turn order, the first the baseline (default: all the study's, "
        "in the order above)",
    )
    p.add_argument(
        "--pool-fraction",
        type=float,
        help="KV pool (num_pages) as a fraction of the working set, every request's prompt + "
        "max_tokens (default: order: the preset's pool, or --num-pages; admission: "
        f"{DEFAULT_POOL_FRACTION['admission']}; swap: {DEFAULT_POOL_FRACTION['swap']}); "
        "--num-pages wins. max_model_len becomes the longest request's (the engine "
        "wants a pool that holds it) unless --max-model-len",
    )
    p.add_argument("--workload-seed", type=int, default=0, help="the workload's draw (%(default)s)")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=4,
        help="requests served untimed on each engine first (%(default)s)",
    )
    group = p.add_argument_group("admission and swap: the workload")
    group.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="(default: admission: chat-fixed; swap: offline-long) "
        + "; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()),
    )
    group.add_argument("--num-requests", type=int, help="only the first N requests")
    group = p.add_argument_group("order: N passages x Q questions about each, shuffled")
    group.add_argument("--num-passages", type=int, help="passages (16)")
    group.add_argument("--num-questions", type=int, help="questions per passage (4)")
    group.add_argument(
        "--passage-tokens", help="passage lengths, log-uniform between LO,HI tokens (256,1200)"
    )
    group.add_argument("--output-len", help="max_tokens uniform in LO,HI (16,256)")
    group.add_argument(
        "--source",
        choices=SOURCES,
        help="text: Python-doc passages through the chat template; random: token ids (any "
        "model) (text)",
    )
    add_config_overrides(p)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The study's defaults filled in, its variants a list; a flag of another study, or one
    that cannot run, is an error."""
    _, allowed = KNOBS[args.command]
    args.variants = [v for v in (args.variants or ",".join(allowed)).split(",") if v]
    bad = [v for v in args.variants if v not in allowed]
    if bad or not args.variants:
        p.error(f"unknown --variants {bad}; choose from {list(allowed)}")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.pool_fraction is None:
        args.pool_fraction = DEFAULT_POOL_FRACTION[args.command]
    elif not args.pool_fraction > 0:
        p.error(f"--pool-fraction must be > 0, got {args.pool_fraction}")
    order_flags = [k for k in ORDER_DEFAULTS if getattr(args, k) is not None]
    if args.command == "order":
        if args.workload is not None or args.num_requests is not None:
            p.error("--workload and --num-requests are admission's and swap's: order draws "
                    "passages and questions (--num-passages, --num-questions)")  # fmt: skip
        for key, default in ORDER_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        args.output_len = pair(args.output_len, "--output-len", p)
        args.passage_tokens = pair(args.passage_tokens, "--passage-tokens", p)
    elif order_flags:
        flags = ", ".join("--" + k.replace("_", "-") for k in order_flags)
        p.error(f"{flags}: order's flags, not {args.command}'s")
    elif args.workload is None:
        args.workload = DEFAULT_WORKLOADS[args.command]


def pair(text: str, flag: str, parser: argparse.ArgumentParser) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"{flag} must be LO,HI (two integers), got {text!r}")
    return lo, hi


def load_workload(args: argparse.Namespace, model_dir: Path) -> Workload:
    from jaxcb.models.loading.loader import read_hf_config

    vocab = read_hf_config(model_dir).get("vocab_size", 32000)
    try:
        if args.command == "order":
            return passage_questions(
                model_dir,
                num_passages=args.num_passages,
                num_questions=args.num_questions,
                seed=args.workload_seed,
                output_len=args.output_len,
                passage_tokens=args.passage_tokens,
                source=args.source,
                vocab_size=vocab,
            )
        return make_workload(
            args.workload,
            num_requests=args.num_requests,
            vocab_size=vocab,
            seed=args.workload_seed,
            model_dir=model_dir,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def engine_overrides(args: argparse.Namespace, workload: Workload) -> tuple[dict[str, Any], int]:
    """The flags' config overrides, with a max_model_len that fits and the pool that
    --pool-fraction asks for; and the working set in pages."""
    overrides = config_overrides(args, workload.max_seq_len, log)
    page = EngineConfig.from_yaml(args.config, **overrides).cache.page_size
    pages = [-(-(len(r.prompt_token_ids) + r.max_tokens) // page) for r in workload.requests]
    working_set = sum(pages)
    sized = "num_pages" in overrides or "kv_cache_memory_gb" in overrides
    if args.pool_fraction is not None and not sized:
        # never below the longest request (and the watermark's page): it must fit alone;
        # and the engine wants room for max_model_len, so that fits the longest request too
        num_pages = max(math.ceil(args.pool_fraction * working_set), max(pages) + 2)
        overrides["num_pages"] = num_pages
        if args.cfg_max_model_len is None:
            overrides["max_model_len"] = max(pages) * page
        log(
            f"KV pool: {num_pages} pages of {page} tokens, {num_pages / working_set:.2f} of "
            f"the working set ({working_set} pages)"
        )
    return overrides, working_set


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    knob, _ = KNOBS[args.command]
    if args.config is None:
        args.config = MODEL_CONFIGS.get(str(args.model), DEFAULT_CONFIG)
    model_dir = resolve_model(args.model)
    workload = load_workload(args, model_dir)
    log(
        f"model {model_dir}; workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.prompt_tokens:,} prompt + {workload.output_tokens:,} output tokens"
    )
    overrides, working_set = engine_overrides(args, workload)
    result = run_variants(
        knob,
        args.variants,
        workload,
        model_dir=model_dir,
        config=args.config,
        overrides=overrides,
        repeats=args.repeats,
        warmup_requests=args.warmup_requests,
        log=log,
    )
    rows = summarize(args.variants, result)
    print_table(knob, rows)
    record |= dict(
        command=args.command,
        knob=knob,
        model=str(model_dir),
        workload=workload.summary() | {"working_set_pages": working_set},
        overrides=overrides,
        engines=result["info"],
        passes=result["passes"],
        summary=rows,
    )
