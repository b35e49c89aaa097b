"""Step traces: what every engine step held, recorded from a real run, saved as JSON.

An engine keeps a `StepRecord` of every step while `record_steps()` is on: the bucket (token
slots the step ran), the chunks in it as (request id, tokens, "prefill" | "decode"), the real
tokens, the padded-batch baselines' batch padding, KV pages in use after the step, the
requests preempted, and the token budget the step was scheduled under (`token_budget`: the
ITL controller's choice when `itl_target_ms` is set, else max_num_batched_tokens). This
module records such a list around any piece of work, saves it with what a reader needs to
interpret it (buckets, pool size, batching mode, model), and loads it back;
`jaxcb.bench.plots.plot_trace` draws it (`python -m jaxcb.bench plot_trace`). A server
writes one of all its steps with `serve.py --step-trace PATH`.

    with recording(llm) as steps:
        llm.generate(prompts, params)
    save_trace("trace.json", steps, trace_meta(llm))
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMAT = "jaxcb-step-trace-v1"


def _engine(llm_or_engine: Any) -> Any:
    return getattr(llm_or_engine, "engine", llm_or_engine)


@contextlib.contextmanager
def recording(llm_or_engine: Any) -> Iterator[list[dict[str, Any]]]:
    """Record the steps run inside the block (of an `LLM` or an engine); the yielded list
    holds them, as JSON-ready dicts, once the block is over."""
    engine = _engine(llm_or_engine)
    steps: list[dict[str, Any]] = []
    engine.record_steps(True)
    try:
        yield steps
    finally:
        steps.extend(record.to_dict() for record in engine.pop_step_records())
        engine.record_steps(False)


def trace_meta(llm_or_engine: Any, **extra: Any) -> dict[str, Any]:
    """What a reader of the trace needs: buckets, KV pool size, batching mode, model, the
    ITL controller's target (None: a fixed budget)."""
    engine = _engine(llm_or_engine)
    sched, info = engine.config.scheduler, engine.info
    return dict(
        model=info.model_path,
        dtype=engine.config.dtype,
        batching=sched.batching,
        buckets=info.token_buckets,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        itl_target_ms=sched.itl_target_ms,
        itl_percentile=sched.itl_percentile,
        kv_pages_total=info.num_pages,
        page_size=info.page_size,
        **extra,
    )


def save_trace(path: str | Path, steps: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(format=FORMAT, meta=meta, steps=steps)) + "\n")
    return path


def load_trace(path: str | Path) -> dict[str, Any]:
    """{"format", "meta", "steps"}; ValueError if the file is not a step trace."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a step trace from {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    return data


def summarize_trace(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the steps: slots, real tokens (prefill / decode), padding, preemptions."""
    slots = sum(s["bucket"] for s in steps)
    real = sum(s["num_tokens"] for s in steps)
    prefill = sum(n for s in steps for _, n, kind in s["chunks"] if kind == "prefill")
    batch_padding = sum(s.get("batch_padding", 0) for s in steps)
    return dict(
        steps=len(steps),
        token_slots=slots,
        tokens=real,
        prefill_tokens=prefill,
        decode_tokens=real - prefill,
        padding_tokens=slots - real,
        batch_padding_tokens=batch_padding,
        bucket_padding_tokens=slots - real - batch_padding,
        padding_fraction=(slots - real) / slots if slots else 0.0,
        preemptions=sum(len(s["preempted"]) for s in steps),
        kv_pages_peak=max((s["pages_used"] for s in steps), default=0),
    )
