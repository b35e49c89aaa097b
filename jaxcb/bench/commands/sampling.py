"""Time the jitted sampling function alone: jaxcb.sampling against another copy of it.

Each point is one vocabulary size and one mix of filters over --rows sampled rows; the
function is `sample` as the step calls it (every row real, no penalties or logprobs). It
prints the compile seconds and the median milliseconds per call of each implementation, and
whether they drew the same tokens (they must wherever the kept set lies within the top
FILTER_CANDIDATES; on the "fallback" mix the current code draws by token id, not by rank,
so the tokens differ while the law is the same).

Logits: "peaked" rows have Zipf probabilities (p ~ rank^-2, ids shuffled), so a top-p 0.9
nucleus holds a handful of tokens; "flat" rows are Gaussian (sd 0.5), so it holds most of
the vocabulary and every row leaves the candidate set (the old code's full sort, the new
code's threshold search).

    git show 9529464:jaxcb/sampling.py > /tmp/sampling_old.py   # before issue 18: full sort
    python -m jaxcb.bench sampling --baseline /tmp/sampling_old.py
    python -m jaxcb.bench sampling --vocabs 49152 --mixes fallback --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb import sampling
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.timing import time_interleaved

#: name: (logits kind, temperature, top_k, top_p) per row, cycled over the rows.
MIXES = {
    "top_p": [("peaked", 1.0, 0, 0.9)],
    "top_k": [("peaked", 1.0, 50, 1.0)],
    "mix": [("peaked", 1.0, 0, 0.9), ("peaked", 0.8, 50, 1.0), ("peaked", 0.7, 50, 0.9)],
    "fallback": [("flat", 1.0, 0, 0.9)],
}

DESCRIPTION = "the jitted sampling function alone, against another copy of it (--baseline)"
FLAGS = SharedFlags(repeats=5, repeats_help="timed calls per point", repeats_alias="--iters")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocabs", default="32000,49152,128256,151936")
    parser.add_argument("--rows", type=int, default=128, help="sampled rows per call")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma list of {list(MIXES)}")
    parser.add_argument("--baseline", type=pathlib.Path, help="another sampling.py to time too")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls after compiling")
    parser.add_argument("--seed", type=int, default=0)


def load(path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"sampling_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(mix: str, vocab: int, rows: int, seed: int) -> tuple[jax.Array, dict]:
    rng = np.random.default_rng(seed)
    plan = [MIXES[mix][i % len(MIXES[mix])] for i in range(rows)]
    logits = np.empty((rows, vocab), np.float32)
    zipf = -2.0 * np.log(np.arange(1, vocab + 1))
    for i, (kind, *_) in enumerate(plan):
        if kind == "peaked":
            logits[i] = rng.permutation(zipf) + rng.standard_normal(vocab) * 0.01
        else:
            logits[i] = rng.standard_normal(vocab) * 0.5
    f32, i32 = jnp.float32, jnp.int32
    kwargs = dict(
        temperature=jnp.asarray([p[1] for p in plan], f32),
        top_k=jnp.asarray([p[2] for p in plan], i32),
        top_p=jnp.asarray([p[3] for p in plan], f32),
        min_p=jnp.zeros(rows, f32),
        rng_keys=jnp.asarray(np.stack([np.zeros(rows), np.arange(rows)], 1), jnp.uint32),
        sample_counters=jnp.zeros(rows, i32),
        flags=jnp.asarray([1, 0, 0, 0], i32),
        penalty_args=(  # apply_penalties' arguments: no history (an id past the vocabulary)
            jnp.full((rows, 1), 1 << 30, i32),
            jnp.zeros((rows, 1), f32),
            jnp.zeros(rows, f32),
            jnp.zeros(rows, f32),
            jnp.ones(rows, f32),
        ),
    )
    return jnp.asarray(logits), kwargs


def compile_impl(module: ModuleType, logits, kwargs) -> tuple[jax.stages.Compiled, float]:
    fn = jax.jit(module.sample, static_argnames="num_top_logprobs")
    start = time.perf_counter()
    compiled = fn.lower(logits, num_top_logprobs=1, **kwargs).compile()
    return compiled, time.perf_counter() - start


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    impls = {"new": sampling}
    if args.baseline is not None:
        impls["old"] = load(args.baseline)
    results = []
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {args.rows} rows")
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for mix in args.mixes.split(","):
            logits, kwargs = make_inputs(mix, vocab, args.rows, args.seed)
            point = dict(vocab=vocab, mix=mix, rows=args.rows)
            compiled = {}
            for name, module in impls.items():  # cached after a vocabulary's first mix
                compiled[name], point[f"{name}_compile_s"] = compile_impl(module, logits, kwargs)
            # the implementations' calls interleaved: load from other processes falls on
            # all of them alike
            timings = time_interleaved(
                compiled, (logits,), iters=args.repeats, warmup=args.warmup, kwargs=kwargs
            )
            for name, timing in timings.items():
                point[f"{name}_ms"] = 1e3 * timing.median
                point[f"{name}_tokens"] = np.asarray(timing.output.token_ids)
            line = f"V={vocab:>6} {mix:>8}: new {point['new_ms']:8.1f} ms"
            if "old" in impls:
                same = bool((point["new_tokens"] == point["old_tokens"]).all())
                point["same_tokens"] = same
                line += (
                    f"  old {point['old_ms']:8.1f} ms  x{point['old_ms'] / point['new_ms']:.1f}"
                    f"  compile {point['new_compile_s']:.1f} s vs {point['old_compile_s']:.1f} s"
                    f"  same tokens: {'yes' if same else 'no'}"
                )
            print(line, flush=True)
            drawn = {f"{name}_tokens" for name in impls}  # arrays: compared, not recorded
            results.append({k: v for k, v in point.items() if k not in drawn})
    record["results"] = results
