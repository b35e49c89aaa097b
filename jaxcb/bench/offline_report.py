"""The report of `python -m jaxcb.bench offline`: medians per system, ratios to jaxcb,
agreement.

Everything here works on what the passes left behind (each pass's record, each system's last
`PassResult`, each system's `info()`), so it runs after every system is closed; the printing
functions write the report to stdout, while the script's progress log goes to stderr.
"""

from __future__ import annotations

import statistics
from typing import Any

from jaxcb.bench.base import PassResult
from jaxcb.bench.workloads import Workload

#: The name `--prefix-caching both` runs jaxcb without its prefix cache under.
NO_PREFIX_CACHE = "jaxcb-no-prefix-cache"


def compare_prefix_caching(
    passes: dict[str, list[dict]], workload: Workload
) -> dict[str, float] | None:
    """Medians of jaxcb with and without the prefix cache, and their ratios, printed."""
    if NO_PREFIX_CACHE not in passes:
        return None
    on, off = passes["jaxcb"], passes[NO_PREFIX_CACHE]
    out = {}
    for key in ("mean_ttft_s", "wall_s"):
        out[f"{key}_on"] = statistics.median(p[key] for p in on)
        out[f"{key}_off"] = statistics.median(p[key] for p in off)
    out["ttft_reduction"] = out["mean_ttft_s_off"] / out["mean_ttft_s_on"]
    rate_on, rate_off = output_rate(on), output_rate(off)
    out["tok_s_ratio"] = rate_on / rate_off
    print(
        f"prefix caching on vs off: mean TTFT {out['mean_ttft_s_on']:.2f}s vs "
        f"{out['mean_ttft_s_off']:.2f}s ({out['ttft_reduction']:.1f}x lower); output tok/s "
        f"{rate_on:,.0f} vs {rate_off:,.0f} ({out['tok_s_ratio']:.2f}x)"
    )
    return out


def output_rate(passes: list[dict], extra_tokens: int = 0) -> float:
    """Median over passes of (the pass's output tokens + `extra_tokens`) per second."""
    return statistics.median((p["output_tokens"] + extra_tokens) / p["wall_s"] for p in passes)


def summarize(
    name: str, passes: list[dict], workload: Workload, flops: float, peak: float | None
) -> dict[str, Any]:
    """Medians of one system's passes. Output tokens are the pass's own: on a natural-length
    workload, each system's greedy outputs may end at different places (in bfloat16)."""
    wall = statistics.median(p["wall_s"] for p in passes)
    out = dict(
        system=name,
        passes=len(passes),
        wall_s=wall,
        wall_s_all=[p["wall_s"] for p in passes],
        rate_all=[p["output_tokens"] / p["wall_s"] for p in passes],
        output_tokens=statistics.median(p["output_tokens"] for p in passes),
        output_tok_s=output_rate(passes),
        total_tok_s=output_rate(passes, workload.prompt_tokens),
        useful_gflop_s=flops / wall / 1e9,
    )
    out["mfu"] = out["useful_gflop_s"] / peak if peak else None
    return out


def paired_ratios(rows: list[dict[str, Any]]) -> None:
    """Add `paired_x` to each row: the median over rounds of (jaxcb's output tok/s / its own
    in the same round). Passes of one round ran back to back, so a neighbour's load shifts
    both alike: steadier than the ratio of medians when the load swings."""
    base = next((r for r in rows if r["system"] == "jaxcb"), None)
    for r in rows:
        pairs = list(zip(base["rate_all"], r["rate_all"], strict=False)) if base else []
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


def print_report(
    rows: list[dict[str, Any]],
    infos: dict[str, dict[str, Any]],
    last: dict[str, PassResult],
    workload: Workload,
    peak: float | None,
) -> None:
    """The table of medians, then what each system's info and last pass add to it."""
    base = next((r for r in rows if r["system"] == "jaxcb"), None)
    ends = "at most" if workload.stops else ""
    print(
        f"\n{workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens:,} "
        f"prompt + {ends}{' ' if ends else ''}{workload.output_tokens:,} output tokens"
    )
    head = f"{'system':<16}{'out tok':>8}{'passes':>7}{'wall s':>9}{'out tok/s':>11}"
    head += f"{'total tok/s':>13}{'jaxcb x':>9}{'paired x':>10}{'GFLOP/s':>9}{'MFU':>7}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ratio = f"{base['output_tok_s'] / r['output_tok_s']:.2f}" if base else "-"
        paired = f"{r['paired_x']:.2f}" if r.get("paired_x") is not None else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{r['system']:<16}{r['output_tokens']:>8,.0f}{r['passes']:>7}{r['wall_s']:>9.1f}{r['output_tok_s']:>11,.0f}"
            f"{r['total_tok_s']:>13,.0f}{ratio:>9}{paired:>10}{r['useful_gflop_s']:>9.1f}{mfu:>7}"
        )
    print(
        "(out tok = tokens generated per pass; jaxcb x = jaxcb's output tok/s over the row's, "
        "from the medians; paired x = the median over rounds of the same ratio within a round; "
        "GFLOP/s counts useful work only)"
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
    for name, result in last.items():  # jaxcb rows that preempted: by recompute or by swap
        e = result.extra
        if name.startswith("jaxcb") and e.get("preemptions"):
            print(
                f"{name}: preemptions {e['preemptions']}, swapped out "
                f"{e.get('swapped_out_requests', 0)} ({e.get('swap_seconds', 0.0):.2f}s of "
                f"copies), recomputed for want of host pages {e.get('swap_fallbacks', 0)}"
            )
    if "vllm" in infos:
        v = infos["vllm"]
        print(
            f"vllm: {v['version']}, binding {v['binding']}, load {v['load_seconds']:.0f}s "
            f"(untimed), {v['python']}"
        )
    for name, info in infos.items():
        if name.startswith("llama.cpp"):
            print(f"{name}: {info['file_type']} {info['gguf']}: {' '.join(info['command'])}")
    if "hf-static" in last:
        raw = last["hf-static"].extra["raw_generated_tokens"]
        useful = sum(map(len, last["hf-static"].token_ids))
        print(
            f"hf-static: {raw:,} tokens generated for {useful:,} useful "
            f"({1 - useful / raw:.1%} wasted on batch padding)"
        )


def cross_check(last: dict[str, PassResult]) -> dict[str, dict[str, float]]:
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
        "repetitive outputs, as random weights or prompts give, make agreement easier)"
    )
    return agree
