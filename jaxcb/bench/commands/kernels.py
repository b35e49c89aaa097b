"""Time ragged paged attention: the plain-jnp reference against the kernels of the backend.

On a GPU the Triton kernel runs, on a TPU the Mosaic kernel. On CPU the Pallas kernels exist
only in interpret mode (a correctness tool, far too slow to time), so the engine's two CPU
paths are timed instead: "xla" (pallas_kernels/ragged_paged_attention/xla.py) and "native"
(jaxcb's C++ FFI kernel, if a compiler is available).

For every (batch mix, num_seqs, kv_len) point it prints the median step time, the achieved
bandwidth over the *ideal* traffic (q and out once, each sequence's K/V once per KV head) and
the achieved TFLOP/s over the *useful* causal work (4 * head_dim flops per visible
(query head, key) pair), plus the kernel's max abs difference from the reference.

    python -m jaxcb.bench kernels                       # defaults for the backend present
    python -m jaxcb.bench kernels --mixes decode --num-seqs 64,256 --kv-lens 1024,8192 \\
        --json out/kernels.json
    python -m jaxcb.bench kernels --kv-cache-dtype int8     # quantized pages + their scales

With --kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2 the pages hold codes and a float32 scale per
token and KV head (kv_quant.py), which every implementation reads; the ideal traffic counts
the codes and the scales.
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
from jaxcb.bench.timing import time_calls
from pallas_kernels.ragged_paged_attention import (
    quantize_rows,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

DESCRIPTION = "ragged paged attention: the reference against the backend's kernels"
FLAGS = SharedFlags(
    repeats=10, repeats_help="timed calls per point", repeats_alias="--iters", dtype="bfloat16"
)

MIXES = {
    "decode": "every sequence adds 1 token",
    "prefill": "every sequence adds a chunk of --prefill-chunk tokens (capped at kv_len)",
    "mixed": "one prefill chunk, the other sequences decode",
}

#: --kv-cache-dtype choices -> the pages' dtype (None: --dtype).
KV_DTYPES = {"auto": None, "int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

#: Grids sized for the machine: the reference gathers T x kv_len K/V rows, so CPU stays small.
DEFAULT_GRID = {
    "cpu": dict(num_seqs="2,8", kv_lens="64,256", prefill_chunk=32),
    "accelerator": dict(num_seqs="8,64,256", kv_lens="512,2048,8192", prefill_chunk=256),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mixes",
        default="decode,prefill,mixed",
        help="comma list of batch mixes: " + "; ".join(f"{k}: {v}" for k, v in MIXES.items()),
    )
    parser.add_argument("--num-seqs", help="comma list of sequence counts (default: per backend)")
    parser.add_argument(
        "--kv-lens", help="comma list of per-sequence KV lengths (default: per backend)"
    )
    parser.add_argument("--prefill-chunk", type=int, help="query tokens of a prefill sequence")
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(KV_DTYPES),
        help="the pages' dtype: auto (= --dtype), or int8 / fp8 codes with per-token scales",
    )
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--soft-cap", type=float, default=None)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    parser.add_argument("--seed", type=int, default=0)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = set(args.mixes.split(",")) - set(MIXES)
    if unknown:
        parser.error(f"unknown --mixes {sorted(unknown)}; choose from {sorted(MIXES)}")
    if args.num_q_heads % args.num_kv_heads:
        parser.error(f"{args.num_q_heads=} must be divisible by {args.num_kv_heads=}")


def make_inputs(args, mix: str, num_seqs: int, kv_len: int, key: jax.Array):
    """Inputs of one benchmark point (positional arrays, and the pages' scales by keyword
    when they are quantized), plus its ideal bytes and useful flops."""
    chunk = min(args.prefill_chunk, kv_len)
    q_lens = {
        "decode": [1] * num_seqs,
        "prefill": [chunk] * num_seqs,
        "mixed": [chunk] + [1] * (num_seqs - 1),
    }[mix]
    pages_per_seq = -(-kv_len // args.page_size)
    num_pages = num_seqs * pages_per_seq
    rng = np.random.default_rng(args.seed)
    page_indices = rng.permutation(num_pages).reshape(num_seqs, pages_per_seq).astype(np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1])
    dtype = jnp.dtype(args.dtype)
    kq, kk, kv = jax.random.split(key, 3)
    pages_shape = (args.num_kv_heads, num_pages, args.page_size, args.head_dim)
    k_pages = jax.random.normal(kk, pages_shape, dtype)
    v_pages = jax.random.normal(kv, pages_shape, dtype)
    scales, row_bytes = {}, args.head_dim * dtype.itemsize
    if (kv_dtype := KV_DTYPES[args.kv_cache_dtype]) is not None:
        k_pages, scales["k_scales"] = quantize_rows(k_pages, kv_dtype)
        v_pages, scales["v_scales"] = quantize_rows(v_pages, kv_dtype)
        row_bytes = args.head_dim * jnp.dtype(kv_dtype).itemsize + 4  # + f32 scale
    inputs = (
        jax.random.normal(kq, (num_tokens, args.num_q_heads, args.head_dim), dtype),
        k_pages,
        v_pages,
        jnp.full((num_seqs,), kv_len, jnp.int32),
        jnp.asarray(page_indices),
        jnp.asarray(cu_q_lens),
        jnp.asarray([num_seqs], jnp.int32),
    )
    q_bytes = 2 * num_tokens * args.num_q_heads * args.head_dim * dtype.itemsize  # q, out
    kv_bytes = 2 * num_seqs * kv_len * args.num_kv_heads * row_bytes
    pairs = sum(q * (kv_len - q) + q * (q + 1) // 2 for q in q_lens)  # causal (query, key)
    flops = 4 * args.head_dim * args.num_q_heads * pairs
    return (inputs, scales), num_tokens, q_bytes + kv_bytes, flops


def attention_impls(args: argparse.Namespace, kernel_backend: str | None) -> dict[str, Any]:
    """The jitted implementations to time, by name: the reference, then the backend's kernel
    (GPU/TPU) or the engine's CPU paths ("xla", and "native" where it is built)."""
    attention = dict(
        sm_scale=args.head_dim**-0.5, sliding_window=args.sliding_window, soft_cap=args.soft_cap
    )
    impls = {"reference": jax.jit(functools.partial(ragged_paged_attention_reference, **attention))}
    if kernel_backend is not None:
        impls["kernel"] = jax.jit(
            functools.partial(ragged_paged_attention, backend=kernel_backend, **attention)
        )
    else:
        from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

        impls["xla"] = jax.jit(functools.partial(ragged_paged_attention_xla, **attention))
        if native.available():
            impls["native"] = jax.jit(
                functools.partial(native.ragged_paged_attention_native, **attention)
            )
    return impls


def bench_point(
    args: argparse.Namespace,
    impls: dict[str, Any],
    mix: str,
    num_seqs: int,
    kv_len: int,
    key: jax.Array,
) -> list[dict[str, Any]]:
    """Time every implementation on one (mix, num_seqs, kv_len) point; print and return a
    record per implementation."""
    inputs, num_tokens, nbytes, flops = make_inputs(args, mix, num_seqs, kv_len, key)
    arrays, scales = inputs
    results = {
        name: time_calls(fn, arrays, iters=args.repeats, warmup=args.warmup, kwargs=scales)
        for name, fn in impls.items()
    }
    ref_seconds, ref_out = results["reference"].median, results["reference"].output
    records = []
    for name, timing in results.items():
        seconds, out = timing.median, timing.output
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
        record = dict(
            mix=mix,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            kv_len=kv_len,
            impl=name,
            ms=seconds * 1e3,
            gb_per_s=nbytes / seconds / 1e9,
            tflop_per_s=flops / seconds / 1e12,
            speedup_vs_reference=ref_seconds / seconds,
            max_abs_err=err,
        )
        records.append(record)
        print(
            f"{mix:<8}{num_seqs:>6}{num_tokens:>7}{kv_len:>8}  {name:<10}"
            f"{record['ms']:>9.3f}{record['gb_per_s']:>9.2f}"
            f"{record['tflop_per_s']:>9.4f}{record['speedup_vs_reference']:>9.2f}"
            f"{err:>10.2e}"
        )
    return records


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    platform = jax.default_backend()
    kernel_backend = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(platform)
    grid = DEFAULT_GRID["cpu" if kernel_backend is None else "accelerator"]
    num_seqs_list = [int(x) for x in (args.num_seqs or grid["num_seqs"]).split(",")]
    kv_lens = [int(x) for x in (args.kv_lens or grid["kv_lens"]).split(",")]
    args.prefill_chunk = args.prefill_chunk or grid["prefill_chunk"]

    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({platform}), jax {jax.__version__}, dtype {args.dtype}, "
        f"KV {args.kv_cache_dtype}"
    )
    if kernel_backend is None:
        print(
            "No GPU/TPU: the Pallas kernels run here only in interpret mode, which checks "
            "correctness and is not worth timing. Timing the CPU paths (xla, native) instead."
        )
    impls = attention_impls(args, kernel_backend)

    header = f"{'mix':<8}{'seqs':>6}{'q_tok':>7}{'kv_len':>8}  {'impl':<10}{'ms':>9}"
    header += f"{'GB/s':>9}{'TFLOP/s':>9}{'speedup':>9}{'max_err':>10}"
    print(header)
    print("-" * len(header))
    records = []
    key = jax.random.key(args.seed)
    for mix in args.mixes.split(","):
        for num_seqs in num_seqs_list:
            for kv_len in kv_lens:
                key, sub = jax.random.split(key)
                records += bench_point(args, impls, mix, num_seqs, kv_len, sub)
    record["meta"] = dict(
        device=device.device_kind,
        platform=platform,
        jax=jax.__version__,
        kernel_backend=kernel_backend,
    )
    record["results"] = records
