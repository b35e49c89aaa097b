"""Draw an engine step trace as a PNG: the continuous-batching picture of a real run.

Steps run left to right; each column is one step's bucket, its token slots stacked bottom up:
every real token coloured by its request (prefill pale, decode saturated), then padding (dark
grey: a padded batch's padding, under --batching static or dynamic; light grey: the bucket's
rounding up); a black line is each step's token budget when the ITL controller chose it
(--itl-target-ms). KV pages in use are drawn below, with preemptions marked.

A trace comes from any run that records one:

    python -m jaxcb.bench offline --systems jaxcb --num-requests 32 --trace out/trace.json
    python -m jaxcb.bench compare_batching --trace-dir out/traces   # one per batching mode
    python -m jaxcb.bench plot_trace out/trace.json -o out/trace.png
    python -m jaxcb.bench plot_trace out/trace.json --steps 0:200    # zoom on the first 200

or from a server (`--step-trace PATH`), or from Python: `with
jaxcb.engine.step_trace.recording(llm) as steps: llm.generate(...)`, then `save_trace(path,
steps, trace_meta(llm))`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxcb.bench.commands import SharedFlags, UsageError
from jaxcb.bench.plots import plot_trace, require_matplotlib
from jaxcb.engine.step_trace import load_trace, summarize_trace

DESCRIPTION = "draw a step trace as a PNG: each step's bucket, tokens by request, KV pages"
FLAGS = SharedFlags(json=False, machine=False)  # a drawing: nothing measured here


def parse_steps(text: str) -> tuple[int, int | None]:
    """'A:B' -> (A, B); 'A:' -> (A, None); ':B' -> (0, B)."""
    first, sep, last = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--steps wants A:B, got {text!r}")
    try:
        return int(first or 0), int(last) if last else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps wants integers A:B, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="a step trace JSON file")
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default: TRACE.png)")
    parser.add_argument("--steps", type=parse_steps, default=(0, None), help="A:B, a range")
    parser.add_argument("--title", help="figure title (default: mode, requests, padding)")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        require_matplotlib()
    except ImportError as exc:
        parser.error(str(exc))


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    output = args.output or args.trace.with_suffix(".png")
    first, last = args.steps
    try:
        trace = load_trace(args.trace)
        plot_trace(trace, output, first_step=first, last_step=last, title=args.title)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    s = summarize_trace(trace["steps"][first:last])
    print(
        f"{output}: {s['steps']} steps, {s['tokens']:,} tokens ({s['prefill_tokens']:,} "
        f"prefill, {s['decode_tokens']:,} decode) in {s['token_slots']:,} slots, padding "
        f"{s['padding_fraction']:.1%} ({s['batch_padding_tokens']:,} batch + "
        f"{s['bucket_padding_tokens']:,} bucket), {s['preemptions']} preemptions, peak "
        f"{s['kv_pages_peak']} KV pages"
    )
    budgets = [st.get("token_budget", 0) for st in trace["steps"][first:last]]
    if all(budgets) and len(set(budgets)) > 1:
        print(
            f"token budget (ITL target {trace['meta'].get('itl_target_ms')} ms): "
            f"{min(budgets)}..{max(budgets)}, mean {sum(budgets) / len(budgets):.0f}"
        )
