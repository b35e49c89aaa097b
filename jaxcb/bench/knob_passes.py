"""One scheduling knob's variants served in-process (`python -m jaxcb.bench scheduling`): the
engines, their timed passes, the median row per variant and the table.

Every pass serves the whole workload greedily with EOS ignored, from an empty prefix cache,
so every variant generates the very same tokens' count; what a pass records beside its wall
time is what the scheduler did (the stats() counters of COUNTERS over the pass, prompt tokens
computed, the KV pool's peak).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxcb.bench.base import check_lengths
from jaxcb.bench.workloads import Workload

#: The knob whose variants share one engine (LLM.generate's `order`); every other knob's
#: variant is a config field, one engine each.
ORDER = "order"
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


def requests_of(workload: Workload) -> tuple[list[list[int]], list[Any]]:
    """The workload's prompts and greedy, EOS-ignoring SamplingParams."""
    from jaxcb import SamplingParams

    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        for r in workload.requests
    ]
    return prompts, params


def build_llm(
    model_dir: Path, config: Path, overrides: dict[str, Any], workload: Workload, k: int
) -> tuple[Any, float]:
    """An LLM with `overrides`, warmed up on the workload's first k requests; and the seconds
    it took to build."""
    from jaxcb import LLM

    start = time.perf_counter()
    llm = LLM(model_dir, config=config, **overrides)
    built = time.perf_counter() - start
    if k > 0:
        prompts, params = requests_of(workload)
        llm.generate(prompts[:k], params[:k], use_tqdm=False)
    return llm, built


def engine_info(llm: Any, built: float) -> dict[str, Any]:
    stats = llm.stats()
    return dict(
        config=llm.config.to_dict(),
        build_seconds=built,
        compile_seconds=stats["compile_seconds"],
        kv_pages_total=stats["kv_pages_total"],
    )


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


def run_variants(
    knob: str,
    variants: Sequence[str],
    workload: Workload,
    *,
    model_dir: Path,
    config: Path,
    overrides: dict[str, Any],
    repeats: int,
    warmup_requests: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every variant's passes: for `order`, one engine, the variants taking turns; for a
    config knob, one engine per variant (`knob` set to it), built one after another.
    Returns each variant's passes, its first pass's tokens, and the engines' info."""
    passes: dict[str, list[dict]] = {v: [] for v in variants}
    tokens: dict[str, list] = {}
    info: dict[str, dict] = {}

    def one(variant: str, llm: Any, order: str) -> None:
        log(f"{knob}={variant}: pass {len(passes[variant]) + 1}/{repeats} ...")
        record, toks = timed_pass(llm, workload, order)
        passes[variant].append(record)
        tokens.setdefault(variant, toks)
        log(f"{knob}={variant}: {record['wall_s']:.1f}s, {record['output_tok_s']:,.0f} out tok/s")

    if knob == ORDER:
        llm, built = build_llm(model_dir, config, overrides, workload, warmup_requests)
        info["engine"] = engine_info(llm, built)
        for _ in range(repeats):
            for variant in variants:
                one(variant, llm, variant)
    else:
        for variant in variants:
            log(f"building the engine with {knob}={variant} ...")
            llm, built = build_llm(
                model_dir, config, overrides | {knob: variant}, workload, warmup_requests
            )
            info[variant] = engine_info(llm, built)
            for _ in range(repeats):
                one(variant, llm, "arrival")
            llm = None
            gc.collect()  # one engine's KV pool at a time
    return dict(passes=passes, tokens=tokens, info=info)


def summarize(variants: Sequence[str], result: dict) -> list[dict[str, Any]]:
    """Per variant: the median pass by wall time, its ratio to the first variant, and how
    many requests' tokens differ from the first variant's."""
    rows = []
    base_tokens = result["tokens"][variants[0]]
    for variant in variants:
        runs = sorted(result["passes"][variant], key=lambda r: r["wall_s"])
        row = dict(variant=variant, **runs[len(runs) // 2])
        row["different_requests"] = sum(
            a != b for a, b in zip(result["tokens"][variant], base_tokens, strict=True)
        )
        rows.append(row)
    for row in rows:
        row["speedup"] = row["output_tok_s"] / rows[0]["output_tok_s"]
    return rows


def print_table(knob: str, rows: list[dict[str, Any]]) -> None:
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
