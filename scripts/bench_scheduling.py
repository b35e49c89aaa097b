"""Scheduling benchmarks (docs/scheduling.md): jaxcb in-process, one knob changed at a time.

Each subcommand serves one workload with every variant of its knob, greedy with EOS ignored
(every variant generates the very same number of tokens), and prints a table with each
variant's output tok/s and its ratio to the first variant, what the scheduler did (prompt
tokens computed, preemptions, recomputed and swapped requests) and whether every request's
tokens equal the first variant's.

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

    python scripts/bench_scheduling.py order --json out/order.json
    python scripts/bench_scheduling.py order --num-passages 32 --num-questions 6 --pool-fraction 0.3
    python scripts/bench_scheduling.py admission --json out/admission.json
    python scripts/bench_scheduling.py swap --variants recompute,swap --num-requests 16

Model: smollm2-135m (the real model, with configs/bench-smollm2-cpu.yaml) unless --model;
any EngineConfig field can be overridden (--max-num-seqs 64, --num-pages 2048, ...; a knob's
variant wins over its own flag). A pass starts with an empty prefix cache, after an untimed
warm-up of --warmup-requests on each engine. The machine is shared and noisy: compare the
ratios of one run. The engines of admission and swap are built one after another (their
passes do not alternate).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

try:
    import jaxcb  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxcb.bench.base import check_lengths
from jaxcb.bench.cli import (
    DEFAULT_CONFIG,
    MODEL_CONFIGS,
    add_config_overrides,
    args_record,
    config_overrides,
    machine_record,
    make_log,
    resolve_model,
)
from jaxcb.bench.passage_questions import SOURCES, passage_questions
from jaxcb.bench.workloads import WORKLOADS, Workload, make_workload
from jaxcb.config import EngineConfig

log = make_log()

#: subcommand -> (the knob, its variants in turn order; the first is the baseline)
KNOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "order": ("order", ("arrival", "auto", "prefix")),
    "admission": ("admission", ("greedy", "predicted", "reserve")),
    "swap": ("preemption_mode", ("recompute", "swap", "auto")),
}
DEFAULT_WORKLOADS = {"admission": "chat-fixed", "swap": "offline-long"}
DEFAULT_POOL_FRACTION = {"order": None, "admission": 0.5, "swap": 0.25}
#: stats() counters reported per pass as the difference over the pass (absent keys skipped)
COUNTERS = (
    "steps",
    "preemptions",
    "recomputed_tokens",
    "swapped_out_requests",
    "swapped_in_requests",
    "swap_fallbacks",
    "kv_pages_evicted",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (knob, variants) in KNOBS.items():
        p = sub.add_parser(
            name,
            help=f"{knob}: {' vs '.join(variants)}",
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_common_args(p, name, variants)
        if name == "order":
            add_order_args(p)
        else:
            p.add_argument(
                "--workload",
                default=DEFAULT_WORKLOADS[name],
                choices=sorted(WORKLOADS),
                help="; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()),
            )
            p.add_argument("--num-requests", type=int, help="only the first N requests")
        add_config_overrides(p)
    return parser


def add_common_args(p: argparse.ArgumentParser, name: str, variants: tuple[str, ...]) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="a preset (smollm2-135m, the default; bench-57m) or a Hugging Face model dir",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="jaxcb YAML preset (default: the model's, bench-cpu.yaml for a directory)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--variants",
        default=",".join(variants),
        help="comma list, in turn order, the first the baseline (default: %(default)s)",
    )
    fraction = DEFAULT_POOL_FRACTION[name]
    p.add_argument(
        "--pool-fraction",
        type=float,
        default=fraction,
        help="KV pool (num_pages) as a fraction of the working set, every request's prompt + "
        "max_tokens (default: "
        + (f"{fraction}" if fraction else "the preset's pool, or --num-pages")
        + "); --num-pages wins. max_model_len becomes the longest request's (the engine "
        "wants a pool that holds it) unless --max-model-len",
    )
    p.add_argument("--workload-seed", type=int, default=0, help="the workload's draw (%(default)s)")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=4,
        help="requests served untimed on each engine first (%(default)s)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed passes per variant (1)")
    p.add_argument("--json", type=Path, help="write the config, passes and ratios here")


def add_order_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-passages", type=int, default=16, help="passages (%(default)s)")
    p.add_argument(
        "--num-questions", type=int, default=4, help="questions per passage (%(default)s)"
    )
    p.add_argument(
        "--passage-tokens",
        default="256,1200",
        help="passage lengths, log-uniform between LO,HI tokens (%(default)s)",
    )
    p.add_argument(
        "--output-len", default="16,256", help="max_tokens uniform in LO,HI (%(default)s)"
    )
    p.add_argument(
        "--source",
        default="text",
        choices=SOURCES,
        help="text: Python-doc passages through the chat template; random: token ids (any "
        "model) (%(default)s)",
    )


def pair(text: str, flag: str, parser: argparse.ArgumentParser) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"{flag} must be LO,HI (two integers), got {text!r}")
    return lo, hi


def load_workload(args: argparse.Namespace, parser: argparse.ArgumentParser, model_dir: Path):
    from jaxcb.models.loading.loader import read_hf_config

    vocab = read_hf_config(model_dir).get("vocab_size", 32000)
    try:
        if args.command == "order":
            return passage_questions(
                model_dir,
                num_passages=args.num_passages,
                num_questions=args.num_questions,
                seed=args.workload_seed,
                output_len=pair(args.output_len, "--output-len", parser),
                passage_tokens=pair(args.passage_tokens, "--passage-tokens", parser),
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
        parser.error(str(exc))


def engine_overrides(
    args: argparse.Namespace, parser: argparse.ArgumentParser, workload: Workload
) -> tuple[dict[str, Any], int]:
    """The flags' config overrides, with a max_model_len that fits and the pool that
    --pool-fraction asks for; and the working set in pages."""
    overrides = config_overrides(args, workload.max_seq_len, log)
    page = EngineConfig.from_yaml(args.config, **overrides).cache.page_size
    pages = [-(-(len(r.prompt_token_ids) + r.max_tokens) // page) for r in workload.requests]
    working_set = sum(pages)
    sized = "num_pages" in overrides or "kv_cache_memory_gb" in overrides
    if args.pool_fraction is not None and not sized:
        if not args.pool_fraction > 0:
            parser.error(f"--pool-fraction must be > 0, got {args.pool_fraction}")
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


def build_llm(model_dir: Path, config: Path, overrides: dict[str, Any], workload: Workload, k: int):
    """An LLM with `overrides`, warmed up on the workload's first k requests."""
    from jaxcb import LLM

    start = time.perf_counter()
    llm = LLM(model_dir, config=config, **overrides)
    built = time.perf_counter() - start
    if k > 0:
        prompts, params = requests_of(workload)
        llm.generate(prompts[:k], params[:k], use_tqdm=False)
    return llm, built


def requests_of(workload: Workload) -> tuple[list[list[int]], list[Any]]:
    from jaxcb import SamplingParams

    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        for r in workload.requests
    ]
    return prompts, params


def timed_pass(llm: Any, workload: Workload, order: str) -> tuple[dict[str, Any], list]:
    """One pass from an empty prefix cache: its figures and every request's tokens."""
    prompts, params = requests_of(workload)
    llm.reset_prefix_cache()
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, order=order, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    tokens = [list(o.token_ids) for o in outs]
    check_lengths(order, tokens, workload.requests)
    output_tokens = sum(map(len, tokens))
    queries = after["prefix_queries"] - before["prefix_queries"]
    hits = after["prefix_hits"] - before["prefix_hits"]
    record = dict(
        wall_s=wall,
        output_tokens=output_tokens,
        output_tok_s=output_tokens / wall,
        # prompt tokens computed (admissions' lookups minus hits); 0 lookups: cache off
        prefill_computed=queries - hits if queries else None,
        prefix_hit_rate=hits / queries if queries else None,
        kv_pages_peak=after["kv_pages_peak"],
        admitted_idle_pages=after.get("admitted_idle_pages"),
    )
    record |= {k: after[k] - before[k] for k in COUNTERS if k in after}
    return record, tokens


def run(args: argparse.Namespace, model_dir: Path, workload: Workload, overrides: dict) -> dict:
    """Every variant's passes (round-robin for order, one engine after another otherwise)."""
    knob, _ = KNOBS[args.command]
    passes: dict[str, list[dict]] = {v: [] for v in args.variants}
    tokens: dict[str, list] = {}
    info: dict[str, dict] = {}

    def one(variant: str, llm: Any, order: str) -> None:
        log(f"{knob}={variant}: pass {len(passes[variant]) + 1}/{args.repeats} ...")
        record, toks = timed_pass(llm, workload, order)
        passes[variant].append(record)
        tokens.setdefault(variant, toks)
        log(f"{knob}={variant}: {record['wall_s']:.1f}s, {record['output_tok_s']:,.0f} out tok/s")

    if args.command == "order":
        llm, built = build_llm(model_dir, args.config, overrides, workload, args.warmup_requests)
        info["engine"] = engine_info(llm, built)
        for _ in range(args.repeats):
            for variant in args.variants:
                one(variant, llm, variant)
    else:
        for variant in args.variants:
            log(f"building the engine with {knob}={variant} ...")
            llm, built = build_llm(
                model_dir, args.config, overrides | {knob: variant}, workload, args.warmup_requests
            )
            info[variant] = engine_info(llm, built)
            for _ in range(args.repeats):
                one(variant, llm, "arrival")
            llm = None
            gc.collect()  # one engine's KV pool at a time
    return dict(passes=passes, tokens=tokens, info=info)


def engine_info(llm: Any, built: float) -> dict[str, Any]:
    stats = llm.stats()
    return dict(
        config=llm.config.to_dict(),
        build_seconds=built,
        compile_seconds=stats["compile_seconds"],
        kv_pages_total=stats["kv_pages_total"],
    )


def summarize(args: argparse.Namespace, result: dict) -> list[dict[str, Any]]:
    """Per variant: the median pass by wall time, its ratio to the first variant, and how
    many requests' tokens differ from the first variant's."""
    rows = []
    base_tokens = result["tokens"][args.variants[0]]
    for variant in args.variants:
        runs = sorted(result["passes"][variant], key=lambda r: r["wall_s"])
        row = dict(variant=variant, **runs[len(runs) // 2])
        row["different_requests"] = sum(
            a != b for a, b in zip(result["tokens"][variant], base_tokens, strict=True)
        )
        rows.append(row)
    for row in rows:
        row["speedup"] = row["output_tok_s"] / rows[0]["output_tok_s"]
    return rows


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    knob, _ = KNOBS[args.command]
    cols = [
        ("variant", knob, "{}"),
        ("wall_s", "wall s", "{:.1f}"),
        ("output_tok_s", "out tok/s", "{:,.0f}"),
        ("speedup", f"x {rows[0]['variant']}", "{:.2f}"),
        ("prefill_computed", "prefill computed", "{:,}"),
        ("prefix_hit_rate", "hit rate", "{:.2f}"),
        ("preemptions", "preempt", "{}"),
        ("recomputed_tokens", "recomputed tok", "{:,}"),
        ("swapped_out_requests", "swapped out", "{}"),
        ("swap_fallbacks", "swap fallbacks", "{}"),
        ("steps", "steps", "{}"),
        ("different_requests", "tokens differ", "{}"),
    ]
    cols = [c for c in cols if any(c[0] in r for r in rows)]

    def cell(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    table = [[h for _, h, _ in cols]] + [[cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    same = all(r["different_requests"] == 0 for r in rows)
    print(f"identical tokens in every variant: {'yes' if same else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    knob, allowed = KNOBS[args.command]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in allowed]
    if bad or not args.variants:
        parser.error(f"unknown --variants {bad}; choose from {list(allowed)}")
    if args.repeats < 1 or args.warmup_requests < 0:
        parser.error("--repeats must be >= 1 and --warmup-requests >= 0")
    if args.config is None:
        args.config = MODEL_CONFIGS.get(str(args.model), DEFAULT_CONFIG)
    machine = machine_record()
    model_dir = resolve_model(args.model)
    workload = load_workload(args, parser, model_dir)
    log(
        f"model {model_dir}; workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.prompt_tokens:,} prompt + {workload.output_tokens:,} output tokens"
    )
    overrides, working_set = engine_overrides(args, parser, workload)
    result = run(args, model_dir, workload, overrides)
    rows = summarize(args, result)
    print_table(args, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = dict(
            command=args.command,
            knob=knob,
            args=args_record(args),
            machine=machine,
            model=str(model_dir),
            workload=workload.summary() | {"working_set_pages": working_set},
            overrides=overrides,
            engines=result["info"],
            passes=result["passes"],
            summary=rows,
        )
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
