"""Time the native grouped matmul of a mixture of experts against dense packed matmuls.

T tokens are routed top-k among E experts (random distinct experts per token), so the
grouped matmul multiplies T * k rows, sorted by expert, each by its expert's [K, I] matrix
(models/packed.py's grouped_matmul over a stack of packed weights, as a mixture of
experts' layer calls it). It is compared with:

    dense rows    one packed matmul of the same T * k rows by one [K, I] matrix: the same
                  arithmetic, but one matrix's weights read where the grouped one reads
                  every chosen expert's
    dense active  one packed matmul of the T tokens by a [K, k * I] matrix: a dense layer of
                  the same active parameters (the same arithmetic; the same weight bytes
                  while T is small enough that the tokens choose only k experts in all)
    ragged_dot    (--ragged) XLA's jax.lax.ragged_dot, which the CPU computes densely: every
                  row times every expert, masked

and prints the median times and the ratios. With --op swiglu the grouped and dense matmuls
are SwiGLU ([K, 2 * I] gate_up matrices, [rows, I] out; fused into the matmul's epilogue
where the kernel has that, as in the model code).

    python -m jaxcb.bench grouped_matmul                       # float32, T = 1,16,128,512
    python -m jaxcb.bench grouped_matmul --dtype bfloat16 --op swiglu --ragged

The machine line names the CPU and the ISA level of the native kernels; --json writes the
times of every T.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb import native
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.timing import median_seconds
from jaxcb.models import packed
from jaxcb.models.cpu_params import matmul_backend

DESCRIPTION = "a mixture of experts' grouped matmul on the native CPU kernels against dense ones"
FLAGS = SharedFlags(
    repeats=50, repeats_help="timed calls per point", repeats_alias="--iters", dtype="float32"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="1,16,128,512", help="comma list of token counts T")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--k", type=int, default=512, help="input features (hidden size)")
    parser.add_argument("--i", type=int, default=1024, help="output features (expert FFN size)")
    parser.add_argument(
        "--kernel", default="auto", help="a PACKED_MATMULS name (auto: the engine's choice)"
    )
    parser.add_argument("--op", default="matmul", choices=["matmul", "swiglu"])
    parser.add_argument("--ragged", action="store_true", help="also time jax.lax.ragged_dot")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)


def route(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """i32[E]: how many of the T * top_k (token, expert) rows each expert gets."""
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(chosen.ravel(), minlength=experts).astype(np.int32)


def _unfused_swiglu(matmul, x: jax.Array, w: jax.Array) -> jax.Array:
    gate_up = matmul(x, w).reshape(x.shape[0], 2, -1)
    return jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]


def bench(args: argparse.Namespace, kernel: str, tokens: int, rng: np.random.Generator) -> dict:
    spec = native.PACKED_MATMULS[kernel]
    fused = args.op == "swiglu"
    n = 2 * args.i if fused else args.i  # columns of one expert's matrix
    rows = tokens * args.top_k
    weights = rng.standard_normal((args.experts, args.k, n)).astype(np.float32) * 0.05
    weights = weights.astype(spec.dtype)
    stack = jnp.asarray(native.pack_experts(kernel, weights))
    sizes = jnp.asarray(route(rng, tokens, args.experts, args.top_k))
    x = jnp.asarray(rng.standard_normal((rows, args.k)), jnp.float32)
    # As the model code calls them (a kernel without a fused SwiGLU, AMX: matmul, then silu).
    grouped_op = packed.grouped_swiglu if fused else packed.grouped_matmul

    def grouped(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        return grouped_op(x, {kernel: w}, sizes)

    dense = spec.kernel
    if fused:
        dense = spec.swiglu or functools.partial(_unfused_swiglu, spec.kernel)
    one = jnp.asarray(spec.pack(weights[0]))
    # k experts' matrices side by side (gate blocks, then up: the fused order).
    active = weights[: args.top_k]
    if fused:
        active = active.reshape(args.top_k, args.k, 2, args.i).transpose(1, 2, 0, 3)
    else:
        active = active.transpose(1, 0, 2)
    wide = jnp.asarray(spec.pack(np.ascontiguousarray(active).reshape(args.k, -1)))
    times = {
        "grouped": median_seconds(jax.jit(grouped), (x, stack, sizes), args.repeats, args.warmup),
        "dense rows": median_seconds(jax.jit(dense), (x, one), args.repeats, args.warmup),
        "dense active": median_seconds(
            jax.jit(dense), (x[:tokens], wide), args.repeats, args.warmup
        ),
    }
    if args.ragged:

        def ragged(x, w, sizes):
            out = jax.lax.ragged_dot(
                x.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32
            )
            return jax.nn.silu(out[:, : args.i]) * out[:, args.i :] if fused else out

        plain = jnp.asarray(weights)
        iters = max(3, args.repeats // 10)  # (slow: every row times every expert)
        times["ragged_dot"] = median_seconds(jax.jit(ragged), (x, plain, sizes), iters, 1)
    return times


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    if not native.available():
        raise SystemExit("the native CPU kernels are not available here")
    dtype = jnp.dtype(args.dtype)
    kernel = args.kernel
    if kernel == "auto":
        kernel = matmul_backend("auto", dtype=dtype, tensor_parallel_size=1)
    if kernel not in native.GROUPED_TARGETS:
        raise SystemExit(f"no grouped kernel for {kernel!r} ({args.dtype})")
    rng = np.random.default_rng(args.seed)
    print(f"kernel {kernel}")
    print(
        f"{args.op}: {args.experts} experts, top-{args.top_k}, K={args.k}, I={args.i}, "
        f"{args.dtype}; median of {args.repeats} calls"
    )
    header = f"{'T':>5} {'rows':>5} {'grouped ms':>11} {'dense rows':>11} {'dense active':>13}"
    print(header + "  grouped/rows  grouped/active" + ("  ragged_dot ms" if args.ragged else ""))
    record |= dict(kernel=kernel, results=[])
    for tokens in (int(t) for t in args.tokens.split(",")):
        t = bench(args, kernel, tokens, rng)
        record["results"].append(dict(tokens=tokens, rows=tokens * args.top_k, seconds=t))
        line = (
            f"{tokens:>5} {tokens * args.top_k:>5} {t['grouped'] * 1e3:>11.3f} "
            f"{t['dense rows'] * 1e3:>11.3f} {t['dense active'] * 1e3:>13.3f}  "
            f"{t['grouped'] / t['dense rows']:>12.2f}  {t['grouped'] / t['dense active']:>14.2f}"
        )
        if args.ragged:
            line += f"  {t['ragged_dot'] * 1e3:>13.3f}"
        print(line, flush=True)
