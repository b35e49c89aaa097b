"""The host's gap between device steps, with async scheduling off and on, on one engine.

N requests decode together (greedy by default, EOS ignored; seeded top-p sampling with
--sampled); after their prefills, --steps decode steps are timed, the modes taking turns for
--repeats rounds. Per mode:

- wall: seconds per step.
- gap: how long the device waits for the host between two steps. Synchronously, at least
  the time from one step's results being read back to the next step's dispatch (the host
  schedules, detokenizes, checks stops and packs meanwhile; measured directly). With async
  scheduling the next step is dispatched before the host reads the last one back: the
  device waits only if it has finished the last step by the time the next is dispatched,
  which is checked (without blocking) at every dispatch; "idle" counts those steps.
- device: the same steps' inputs dispatched again back to back, with no host work between
  them (the recorded inputs, replayed after each round): the device time per step, and
  wall - device, the gap as the wall clock sees it (noisier: two measurements).

The engine's own host_seconds / device_seconds per step are printed too (with async
scheduling, host seconds overlap the device's). On a CPU the "device" is the same cores:
host work that overlaps a step slows it by the cores it takes, which wall - device counts.
The machine is shared: compare the ratios of one run, not absolute times across runs.

    python -m jaxcb.bench host_gap                      # SmolLM2-135M (LLM()'s default), 128
    python -m jaxcb.bench host_gap --num-seqs 64 --steps 32 --sampled
    python -m jaxcb.bench host_gap --model jaxcb-tiny-random-llama-v1

Every engine flag applies (--model, --dtype, --config and one per config field, as
scripts/serve.py takes them); --json writes every round and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import numpy as np

from jaxcb import LLM, SamplingParams
from jaxcb.bench.commands import SharedFlags
from jaxcb.cli import add_engine_args, engine_config_from_args

DESCRIPTION = "the host's gap between device steps, async scheduling off and on, one engine"
#: (the engine's own flags, jaxcb/cli.py's, bring --model, --dtype and --config)
FLAGS = SharedFlags(repeats=3, repeats_help="rounds of each mode, in turns")
OWN_FLAGS = {"num_seqs", "prompt_len", "steps", "repeats", "sampled", "config", "json"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, default=128, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--sampled", action="store_true", help="seeded top-p sampling, not greedy")
    add_engine_args(parser)


class Recorder:
    """Wraps the runner's `dispatch` and `collect`: every step's bucket and packed input,
    when it was dispatched, whether the step before had finished by then, and when each
    step's results were read back."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.inputs: list[tuple[Any, Any]] = []
        self.dispatched: list[float] = []  # perf_counter() when each dispatch began
        self.idle: list[bool] = []  # the previous step had finished by then
        self.collected: dict[int, float] = {}  # id(handle) -> perf_counter() after collect
        self.handles: list[Any] = []
        self._dispatch, self._collect = runner.dispatch, runner.collect
        runner.dispatch, runner.collect = self.dispatch, self.collect

    def dispatch(self, bucket: Any, inp: Any) -> Any:
        self.idle.append(bool(self.handles) and self.handles[-1].token_ids.is_ready())
        self.dispatched.append(time.perf_counter())
        self.inputs.append((bucket, inp))
        handle = self._dispatch(bucket, inp)
        self.handles.append(handle)
        return handle

    def collect(self, handle: Any) -> Any:
        result = self._collect(handle)
        self.collected[id(handle)] = time.perf_counter()
        return result

    def host_gaps(self, first: int) -> list[float]:
        """Per step from `first` on: its dispatch minus the read-back of the step before, if
        that came first (the device waited at least that long); 0 otherwise."""
        gaps = []
        for i in range(max(first, 1), len(self.handles)):
            done = self.collected.get(id(self.handles[i - 1]))
            gaps.append(max(0.0, self.dispatched[i] - done) if done is not None else 0.0)
        return gaps

    def replay(self, first: int) -> float:
        """Seconds to run the recorded steps from `first` on back to back, host work aside."""
        jax.block_until_ready(self.runner.state)
        t0 = time.perf_counter()
        for bucket, inp in self.inputs[first:]:
            pending = self._dispatch(bucket, inp)
        jax.block_until_ready(pending.token_ids)
        return time.perf_counter() - t0


def one_round(llm: LLM, rec: Recorder, args: argparse.Namespace, on: bool) -> dict:
    engine = llm.engine
    llm.reset_prefix_cache()  # (a replay rewrote pages with other tokens)
    engine.async_scheduling = on
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    for i in range(args.num_seqs):
        params = SamplingParams(
            max_tokens=args.steps + 16,
            ignore_eos=True,
            temperature=0.8 if args.sampled else 0.0,
            top_p=0.9 if args.sampled else 1.0,
            seed=i if args.sampled else None,
        )
        engine.add_request(None, rng.integers(3, vocab, size=args.prompt_len).tolist(), params)
    while engine.num_waiting or any(not r.is_decoding for r in engine.scheduler.running):
        engine.step()  # prefills (and the first decodes)
    for _ in range(2):
        engine.step()
    before, first = engine.stats(), len(rec.inputs)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    after = engine.stats()
    gaps, idle = rec.host_gaps(first), rec.idle[first:]
    rows = {b.num_seqs for b, _ in rec.inputs[first:]}
    for rid in list(engine.output_processor.groups):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    device = rec.replay(first) / (len(rec.inputs) - first)
    steps = after["steps"] - before["steps"]
    return {
        "wall": wall,
        "gap": statistics.fmean(gaps),
        "idle": sum(idle),
        "steps": len(idle),
        "device": device,
        "host_s": (after["host_seconds"] - before["host_seconds"]) / steps,
        "device_s": (after["device_seconds"] - before["device_seconds"]) / steps,
        "rows": rows,
    }


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    given = engine_config_from_args(args)
    # Two buckets: the decodes' (T = S = num_seqs) and one for the prefills (flags override).
    base = {
        "max_num_seqs": args.num_seqs,
        "max_num_batched_tokens": max(256, args.num_seqs),
        "token_buckets": [args.num_seqs, max(256, args.num_seqs)],
        "seq_buckets": [],
        "max_model_len": 1024,
    }
    flags = {name for name in vars(args) if name not in OWN_FLAGS}
    t0 = time.perf_counter()
    llm = LLM(config=given.replace(**{k: v for k, v in base.items() if k not in flags}))
    built = time.perf_counter() - t0
    print(f"engine ready in {built:.0f} s: {llm.engine.info.model_name}")
    rec = Recorder(llm.engine.runner)
    results: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.repeats):
        for on in (False, True):
            res = one_round(llm, rec, args, on)
            results[on].append(res)
            print(f"round {r} async {'on ' if on else 'off'}: {describe(res)}")
    print("\nmedians over rounds:")
    medians = {}
    for on in (False, True):
        rows = results[on]
        median = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "rows"}
        median["idle"] = sum(x["idle"] for x in rows)
        median["steps"] = sum(x["steps"] for x in rows)
        median["rows"] = set().union(*(x["rows"] for x in rows))
        print(f"  async {'on ' if on else 'off'}: {describe(median)}")
        medians[on] = median
    record |= dict(
        engine=dict(model=llm.engine.info.model_name, build_seconds=built),
        **{
            f"async_{'on' if on else 'off'}": dict(
                rounds=[r | {"rows": sorted(r["rows"])} for r in results[on]],
                medians=medians[on] | {"rows": sorted(medians[on]["rows"])},
            )
            for on in (False, True)
        },
    )


def describe(res: dict) -> str:
    ms, wall = 1e3, res["wall"]
    return (
        f"wall {wall * ms:7.2f} ms/step, gap {res['gap'] * ms:5.2f} ({res['gap'] / wall:5.1%}),"
        f" device idle at {res['idle']}/{res['steps']} dispatches; replayed "
        f"{res['device'] * ms:7.2f} (wall - that: {(wall - res['device']) / wall:6.1%}); engine "
        f"host {res['host_s'] * ms:5.2f} / device {res['device_s'] * ms:6.2f}; "
        f"S={sorted(res['rows'])}"
    )
