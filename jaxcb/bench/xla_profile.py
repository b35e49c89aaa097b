"""Where an engine step's time goes on the CPU: jax's profiler trace, op by op, by kind.

`jax.profiler.trace(dir, create_perfetto_trace=True)` records, for every executable run, one
event per XLA:CPU thunk (a custom call, a fusion, a copy, a conditional) with its HLO op name,
the module and a run id. The op names alone do not say what a custom call is, so `op_kinds`
reads the compiled step's HLO text (`Compiled.as_text()`) and sorts each op into a kind:

  matmul      jaxcb's native matmul / SwiGLU kernels (qkv, o, gate·up, down)
  lm_head     the native LM head kernels (matmul + greedy argmax / bf16 screen)
  xla_dot     a dot XLA runs itself (XNNPACK's ynn_fusion or Eigen): an LM head that is not
              native, e.g. a float32 tied embedding's
  attention   ragged paged attention; kv_write its in-place KV cache write
  norm        RMS norm's fusions (reduce, rsqrt, scale); rope the rotary embedding's
  residual    the residual adds; sampling the sampler's conditionals and compares
  other       anything else (the embedding gather, converts, copies)

A while loop (the layers' `lax.scan`) has an event of its own spanning its body's ops, which
have theirs: it is kind `loop` and counted nowhere, so no time is counted twice.

`run_profiles` then sums, per run, the op time of each kind and the run's span (first op's
start to last op's end); span minus the summed op time is the thunk executor's own overhead
and idle gaps (ops run one after another here, each custom call spreading over the threads
itself). Everything is a plain dict, so a script can group runs by what the step held.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

KINDS = (
    "matmul",
    "lm_head",
    "xla_dot",
    "attention",
    "kv_write",
    "norm",
    "rope",
    "residual",
    "sampling",
    "other",
)
_TARGET_KINDS = (
    ("argmax", "lm_head"),
    ("screen", "lm_head"),
    ("matmul", "matmul"),
    ("swiglu", "matmul"),
    ("attention", "attention"),
    ("kv_write", "kv_write"),
)
#: fusion name prefixes (XLA names a fusion after its ops) -> kind
_FUSION_KINDS = (
    ("ynn_fusion", "norm"),  # the sum of squares, by XNNPACK
    ("add_rsqrt", "norm"),
    ("multiply_multiply", "norm"),
    ("multiply_add", "rope"),
    ("slice_bitcast", "rope"),
    ("cosine", "rope"),
    ("negate_concatenate", "rope"),
    ("wrapped_add", "residual"),
    ("bitcast_add", "residual"),
    ("compare", "sampling"),
    ("cond", "sampling"),
)
#: A while loop's own event (the layers' scan) spans its body's ops, which are traced too.
LOOP = "loop"
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """HLO op name -> kind (see the module docstring), for every op of every computation."""
    with_dot, current = set(), None
    for line in hlo_text.splitlines():  # the computations that hold a dot
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(", line)
        if head:
            current = head.group(1)
        elif " dot(" in line and current:
            with_dot.add(current)
    kinds = {}
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, rest = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        if re.search(r"\bwhile\(", rest):
            kinds[name] = LOOP  # (its body's ops are traced one by one: counted there)
        elif target:
            t = target.group(1)
            kinds[name] = next((k for key, k in _TARGET_KINDS if key in t), "other")
        elif " dot(" in rest or (calls and calls.group(1) in with_dot):
            kinds[name] = "xla_dot"
        else:
            kinds[name] = next((k for p, k in _FUSION_KINDS if name.startswith(p)), "other")
    return kinds


def load_events(log_dir: str | Path) -> list[dict[str, Any]]:
    """The complete ("X") events of the newest perfetto trace under `log_dir`."""
    traces = sorted(Path(log_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(traces[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def run_profiles(
    events: list[dict[str, Any]], kinds: dict[str, str], module: str = "step"
) -> list[dict[str, Any]]:
    """One dict per run of an executable whose module name contains `module`, in time
    order: span_ms, ops_ms (summed op time), and ms per kind."""
    runs: dict[str, dict[str, Any]] = {}
    for e in events:
        args = e.get("args") or {}
        op, run = args.get("hlo_op"), args.get("run_id")
        if op is None or run is None or module not in args.get("hlo_module", ""):
            continue
        r = runs.setdefault(run, dict(start=e["ts"], end=e["ts"], ms=defaultdict(float)))
        r["start"], r["end"] = min(r["start"], e["ts"]), max(r["end"], e["ts"] + e["dur"])
        kind = kinds.get(op, "other")
        if kind != LOOP:
            r["ms"][kind] += e["dur"] / 1e3
    out = []
    for r in sorted(runs.values(), key=lambda r: r["start"]):
        ms = {k: r["ms"].get(k, 0.0) for k in KINDS}
        out.append(dict(start_us=r["start"], span_ms=(r["end"] - r["start"]) / 1e3, **ms))
        out[-1]["ops_ms"] = sum(ms.values())
    return out
