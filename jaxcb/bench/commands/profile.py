"""Where jaxcb's step time goes, on the CPU: a workload run under jax's profiler, every step's
XLA ops summed by kind (matmul, attention, norm, rope, ...; jaxcb/bench/xla_profile.py), the
steps grouped by what they held, beside the host's share.

Phases: `decode` steps hold only decode tokens; `prefill` steps hold prompt tokens (with or
without decodes beside them). Per phase, per step (means): the step's wall time in the engine
(`LLMEngine.step`, Python included), the executable's run (`runner.execute`: dispatch, run,
fetch), the ops' span in the trace, and each kind's op time; "executor" is the span minus the
ops (the thunk executor between ops), "dispatch" the run minus the span (PjRt's argument
handling, the launch, the result fetch), "host" the step minus the run (scheduling, packing
the inputs, processing the outputs in Python).

    python -m jaxcb.bench profile --model smollm2-135m --workload chat-fixed --dtype float32
    python -m jaxcb.bench profile --model smollm2-135m --single --max-tokens 256

--json writes the per-phase means and every step's row.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from jaxcb.bench.cli import (
    add_config_overrides,
    add_workload_args,
    config_overrides,
    load_model_and_workload,
    make_log,
)
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.workloads import single_request
from jaxcb.bench.xla_profile import KINDS, load_events, op_kinds, run_profiles
from jaxcb.engine.step_trace import recording

DESCRIPTION = "where a step's time goes on the CPU: XLA ops by kind per phase, beside the host's"
FLAGS = SharedFlags(model=True, default_model="bench-57m", dtype="float32", config=True)

log = make_log()
COLUMNS = ("step", "execute", "span", *KINDS, "executor", "dispatch", "host")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, jaxcb_model=True, default_workload="chat-fixed")
    parser.add_argument("--max-tokens", type=int, help="override every request's max_tokens")
    parser.add_argument(
        "--single",
        action="store_true",
        help="one request alone (the workload's first short prompt, EOS ignored): single stream",
    )
    add_config_overrides(parser)


class StepTimer:
    """Wraps an engine's `step` and its runner's `execute` to time every step that ran."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.times = engine, []
        self._step, self._execute = engine.step, engine.runner.execute
        self._exec_s: float | None = None
        engine.step, engine.runner.execute = self.step, self.execute

    def execute(self, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = self._execute(*a, **k)
        self._exec_s = time.perf_counter() - start
        return out

    def step(self) -> Any:
        self._exec_s = None
        start = time.perf_counter()
        out = self._step()
        if self._exec_s is not None:
            self.times.append((time.perf_counter() - start, self._exec_s))
        return out

    def restore(self) -> None:
        self.engine.step, self.engine.runner.execute = self._step, self._execute


def profile(llm: Any, prompts: list, params: list) -> tuple[list, list, list]:
    """Steps (records), their (step, execute) seconds, and their trace runs, in order."""
    import jax

    engine = llm.engine
    kinds: dict[str, str] = {}
    runner = engine.runner
    for compiled in runner.programs.all_compiled():
        kinds |= op_kinds(compiled.as_text())
    timer = StepTimer(engine)
    with tempfile.TemporaryDirectory(prefix="jaxcb-profile-") as tmp:
        try:
            with recording(llm) as steps, jax.profiler.trace(tmp, create_perfetto_trace=True):
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            timer.restore()
        runs = run_profiles(load_events(tmp), kinds)
    if not len(steps) == len(timer.times) == len(runs):
        raise RuntimeError(f"{len(steps)} steps, {len(timer.times)} timed, {len(runs)} traced")
    return steps, timer.times, runs


def per_step(steps: list, times: list, runs: list) -> list[dict[str, Any]]:
    """One row per step: its phase, tokens, and milliseconds per COLUMNS."""
    rows = []
    for record, (step_s, exec_s), run in zip(steps, times, runs, strict=True):
        prefill = sum(n for _, n, kind in record["chunks"] if kind == "prefill")
        row = dict(
            phase="prefill" if prefill else "decode",
            bucket=record["bucket"],
            tokens=record["num_tokens"],
            seqs=len(record["chunks"]),
            step=1e3 * step_s,
            execute=1e3 * exec_s,
            span=run["span_ms"],
            **{k: run[k] for k in KINDS},
        )
        row["executor"] = run["span_ms"] - run["ops_ms"]
        row["dispatch"] = row["execute"] - row["span"]
        row["host"] = row["step"] - row["execute"]
        rows.append(row)
    return rows


def print_phases(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per phase, the mean per step of every column, and its share of the step."""
    out = {}
    print(
        f"\n{'phase':<9}{'steps':>6}{'tokens':>8}{'seqs':>6}  "
        + "".join(f"{c:>10}" for c in COLUMNS)
    )
    for phase in ("decode", "prefill"):
        group = [r for r in rows if r["phase"] == phase]
        if not group:
            continue
        mean = {c: statistics.mean(r[c] for r in group) for c in ("tokens", "seqs", *COLUMNS)}
        out[phase] = mean | dict(steps=len(group))
        head = f"{phase:<9}{len(group):>6}{mean['tokens']:>8.0f}{mean['seqs']:>6.0f}  "
        print(head + "".join(f"{mean[c]:>10.2f}" for c in COLUMNS) + "   ms/step")
        print(" " * 31 + "".join(f"{mean[c] / mean['step']:>10.1%}" for c in COLUMNS))
    return out


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    from jaxcb import LLM, SamplingParams

    model_dir, _, workload = load_model_and_workload(args)
    if args.single:
        workload = single_request(workload, args.max_tokens or 256)
    overrides = config_overrides(args, workload.max_seq_len, log)
    # One step at a time: each step's execute is timed whole (async scheduling's dispatch
    # and collect overlap the next step's packing, which has no share of one step to show).
    if overrides.get("async_scheduling") not in (None, False, "false"):
        log("async scheduling off: the profile times one step at a time")
    overrides["async_scheduling"] = False
    llm = LLM(args.jaxcb_model or model_dir, config=args.config, **overrides)
    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(
            max_tokens=args.max_tokens or r.max_tokens,
            temperature=0.0,
            ignore_eos=workload.ignore_eos,
            stop_token_ids=list(workload.stops),
        )
        for r in workload.requests
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    log(f"profiling {len(prompts)} requests of {workload.name} ({args.dtype}) ...")
    rows = per_step(*profile(llm, prompts, params))
    phases = print_phases(rows)
    print(
        "(ms per step; second line: share of the step. span: the executable's ops, first start "
        "to last end; executor: span - ops; dispatch: execute - span; host: step - execute)"
    )
    record |= dict(phases=phases, steps=rows)
