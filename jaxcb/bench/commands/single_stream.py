"""Single-stream decode: one request, 256 greedy tokens, time per output token, jaxcb against
llama.cpp (and vLLM) at equal precision, on the same weights and the same prompt.

The prompt is the first short question of the chat workload (chat-templated token ids, ~40
tokens), EOS ignored, --max-tokens output tokens. Each system serves it --repeats times after
an untimed warm-up, taking turns; medians are reported:

  wall ms/tok     the request's wall time over its output tokens (prefill included; the same
                  definition for every system)
  decode ms/tok   the system's own decode time per token, prefill excluded: jaxcb's mean
                  inter-token latency (engine clock), llama-server's timings.predicted_per_token_ms
  llama-bench     `llama-bench -m FILE -n N -p 0 -t 2 -r R -o json` (tg N from an empty
                  context, llama.cpp's own figure; with --llamacpp-bench)
  paired          with --llama-bench BIN (no llama-server needed): `llama-bench -r 1` on
                  --llama-bench-gguf after every round, taking turns with the systems; each
                  system's tok/s over the same round's llama-bench tok/s, median over the
                  rounds (a small machine's memory speed drifts by 20% between minutes:
                  ratios within a round hold where separate runs' figures do not)
  of limit        (bfloat16 / float32 weights) the bytes a token reads (every layer's matmul
                  weights and the LM head) times tok/s over the memory's read bandwidth,
                  measured by the native probe at the start of the same round
                  (bench/roofline.py): how close to the memory's limit each system decodes

    python -m jaxcb.bench single_stream --model smollm2-135m --dtype float32 \\
        --llamacpp-server <llama.cpp>/build/bin/llama-server --llamacpp-bench \\
        --llamacpp-gguf f32,q4_1 --json out/single.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

from jaxcb.bench.cli import (
    add_config_overrides,
    add_llamacpp_args,
    add_workload_args,
    config_overrides,
    llamacpp_context,
    llamacpp_ggufs,
    load_model_and_workload,
    make_log,
)
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.llamacpp_system import KV_TYPES
from jaxcb.bench.roofline import decode_weight_bytes, measure_read_limit
from jaxcb.bench.systems import SYSTEMS, BenchContext, environment
from jaxcb.bench.workloads import single_request

DESCRIPTION = "one request's decode speed, jaxcb against llama.cpp (and vLLM) on the same weights"
FLAGS = SharedFlags(
    repeats=5,
    repeats_help="timed requests of each system",
    model=True,
    default_model="bench-57m",
    dtype="float32",
    config=True,
)

log = make_log()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, default_workload="chat-fixed", jaxcb_model=True)
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens (%(default)s)")
    parser.add_argument("--systems", default="jaxcb,llama.cpp", help="comma list (%(default)s)")
    parser.add_argument("--vllm-python", type=Path, help="python of vLLM's venv (adds vllm)")
    parser.add_argument(
        "--llamacpp-bench", action="store_true", help="also run llama-bench beside llama-server"
    )
    parser.add_argument(
        "--llama-bench",
        type=Path,
        help="a llama-bench binary: one turn of it after every round (the paired figure)",
    )
    parser.add_argument(
        "--llama-bench-gguf",
        type=Path,
        help="its GGUF file (default: --jaxcb-model where that is a .gguf file)",
    )
    add_llamacpp_args(parser)
    add_config_overrides(parser)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.systems = [s for s in args.systems.split(",") if s]
    if args.vllm_python and "vllm" not in args.systems:
        args.systems.append("vllm")
    bad = [s for s in args.systems if s not in ("jaxcb", "llama.cpp", "vllm")]
    if bad:
        parser.error(f"unknown --systems {bad}; choose from jaxcb, llama.cpp, vllm")
    if ("llama.cpp" in args.systems or args.llamacpp_bench) and not args.llamacpp_server:
        parser.error("llama.cpp needs --llamacpp-server")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2")
    if args.llama_bench:
        if args.llama_bench_gguf is None and str(args.jaxcb_model or "").endswith(".gguf"):
            args.llama_bench_gguf = Path(args.jaxcb_model)
        if args.llama_bench_gguf is None or not args.llama_bench_gguf.is_file():
            parser.error("--llama-bench needs a GGUF file: --llama-bench-gguf (or --jaxcb-model)")
        if not args.llama_bench.is_file():
            parser.error(f"--llama-bench: no such file: {args.llama_bench}")
    args.llamacpp_ggufs = llamacpp_ggufs(args)


def decode_ms(name: str, extra: dict[str, Any], tokens: int) -> float | None:
    """The system's own decode time per token (prefill excluded), if it reports one."""
    if name == "jaxcb":
        return 1e3 * extra["mean_itl_s"]
    if name.startswith("llama.cpp") and extra.get("server_predicted_ms"):
        return extra["server_predicted_ms"] / (tokens - 1)  # the first token comes with prefill
    return None


def llama_bench(
    args: argparse.Namespace, gguf: Path, file_type: str, repeats: int | None = None
) -> dict[str, Any]:
    """llama-bench's tg figure on `gguf` (tokens/s, averaged over `repeats`, default
    --repeats), its KV cache in the weights' precision as the server's where llama-bench
    takes it (bf16; it has no f32 cache type, so an F32 file runs its default f16 cache: less
    to read, if anything)."""
    binary = args.llama_bench or Path(args.llamacpp_server).with_name("llama-bench")
    cmd = [str(binary), "-m", str(gguf), "-n", str(args.max_tokens), "-p", "0"]
    cmd += ["-t", str(args.llamacpp_threads), "-r", str(repeats or args.repeats), "-o", "json"]
    kv = KV_TYPES.get(file_type)
    if kv is not None and kv != "f32":
        cmd += ["-ctk", kv, "-ctv", kv]
    log(" ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return parse_llama_bench(done.stdout) | dict(command=cmd)


def parse_llama_bench(stdout: str) -> dict[str, Any]:
    """The tg row of `llama-bench -o json`: tokens/s (mean, stdev) and ms per token."""
    rows = [r for r in json.loads(stdout) if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not rows:
        raise RuntimeError(f"llama-bench printed no generation row: {stdout[:500]}")
    row = rows[0]
    return dict(
        tok_s=row["avg_ts"], tok_s_stdev=row.get("stddev_ts"), ms_per_token=1e3 / row["avg_ts"]
    )


def build(args: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    """The systems, in turn order (llama.cpp once per GGUF file, one slot)."""
    systems: dict[str, Any] = {}
    try:
        for name in args.systems:
            variants = [(name, ctx)]
            if name == "llama.cpp":
                variants = [
                    (f"llama.cpp-{g or 'dtype'}", replace(ctx, llamacpp_gguf_choice=g))
                    for g in args.llamacpp_ggufs
                ]
            for row, row_ctx in variants:
                log(f"building {row} ...")
                systems[row] = SYSTEMS[name](row_ctx)
    except BaseException:
        for system in systems.values():
            system.close()
        raise
    return systems


#: Bytes a weight of each --dtype takes (no figure against the read limit for other forms).
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2}


def take_turns(
    args: argparse.Namespace, systems: dict[str, Any], tokens: int, read_bytes: int | None = None
) -> tuple[dict[str, list], list[float], list[float]]:
    """--repeats rounds, the systems taking turns: (wall ms/tok, decode ms/tok) per pass;
    with --llama-bench its tok/s after each round; with `read_bytes` the memory's read
    bandwidth (bytes/s, over a buffer of that size) at the start of each round."""
    passes: dict[str, list] = {n: [] for n in systems}
    turns: list[float] = []
    limits: list[float] = []
    for round_ in range(args.repeats):
        if read_bytes:
            limit = measure_read_limit(read_bytes)
            if limit:
                limits.append(limit)
                log(f"read limit {round_ + 1}/{args.repeats}: {limit / 1e9:.1f} GB/s")
        for name, system in systems.items():
            result = system.run_pass()
            passes[name].append(
                (1e3 * result.wall_s / tokens, decode_ms(name, result.extra, tokens))
            )
            log(f"{name} {round_ + 1}/{args.repeats}: {passes[name][-1][0]:.2f} ms/tok (wall)")
        if args.llama_bench:
            turns.append(llama_bench(args, args.llama_bench_gguf, "", repeats=1)["tok_s"])
            log(f"llama-bench {round_ + 1}/{args.repeats}: {turns[-1]:.1f} tok/s")
    return passes, turns, limits if len(limits) == args.repeats else []


def paired(passes: list, turns: list[float]) -> dict[str, float] | None:
    """A system's tok/s over llama-bench's of the same round: median, min, max (None without
    turns)."""
    if not turns:
        return None
    ratios = [1e3 / (d or w) / t for (w, d), t in zip(passes, turns, strict=True)]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))


def share_of_limit(
    tok_s: list[float], limits: list[float], read_bytes: int
) -> dict[str, float] | None:
    """Per round, the bytes a token reads times tok/s over that round's read limit: median,
    min, max (None without limits)."""
    if not limits:
        return None
    shares = [read_bytes * t / lim for t, lim in zip(tok_s, limits, strict=True)]
    return dict(median=statistics.median(shares), min=min(shares), max=max(shares))


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    model_dir, spec, workload = load_model_and_workload(args)
    workload = single_request(workload, args.max_tokens)
    overrides = config_overrides(args, workload.max_seq_len, log)
    ctx = BenchContext(
        model_dir=model_dir,
        jaxcb_model=args.jaxcb_model,
        workload=workload,
        dtype=args.dtype,
        log=log,
        jaxcb_config=args.config,
        jaxcb_overrides=overrides,
        warmup_requests=1,
        vllm_python=args.vllm_python,
        **(llamacpp_context(args) | dict(llamacpp_parallel=1)),
    )
    log(f"model {model_dir}; one request: {workload.prompt_tokens} prompt + {args.max_tokens}")
    read_bytes = None
    if args.dtype in WEIGHT_BYTES and not overrides.get("quantization"):
        read_bytes = decode_weight_bytes(spec, WEIGHT_BYTES[args.dtype])
    systems = build(args, ctx)
    try:
        passes, turns, limits = take_turns(args, systems, args.max_tokens, read_bytes)
        infos = {n: s.info() for n, s in systems.items()}
        ggufs = {
            n: (Path(i["gguf"]), i["file_type"]) for n, i in infos.items() if n.startswith("llama")
        }
    finally:
        for system in systems.values():
            system.close()
    bench = {n: llama_bench(args, *g) for n, g in ggufs.items()} if args.llamacpp_bench else {}
    rows = summarize(passes, infos, bench, args.dtype, turns)
    for row in rows:
        ps = passes[row["system"]]
        tok_s = [1e3 / (d or w) for w, d in ps]
        row["share_of_read_limit"] = share_of_limit(tok_s, limits, read_bytes)
    llama_share = share_of_limit(turns, limits, read_bytes) if turns else None
    print_table(rows, args, turns)
    print_limits(rows, limits, read_bytes, llama_share)
    record |= dict(
        workload=workload.summary(),
        infos=infos,
        passes=passes,
        llama_bench=bench,
        llama_bench_turns=turns,
        decode_read_bytes=read_bytes,
        read_limits=limits,
        llama_bench_share_of_read_limit=llama_share,
        results=rows,
        environment=environment(),
    )


def summarize(
    passes: dict[str, list], infos: dict, bench: dict, dtype: str, turns: list[float] = ()
) -> list[dict[str, Any]]:
    """Medians per system, with llama-bench's figure beside each llama.cpp row, and each
    system's paired ratio to the llama-bench turns (`paired`)."""
    rows = []
    for name, ps in passes.items():
        decode = [d for _, d in ps if d is not None]
        rows.append(
            dict(
                system=name,
                precision=infos[name].get("file_type", dtype),
                wall_ms_per_token=statistics.median(w for w, _ in ps),
                decode_ms_per_token=statistics.median(decode) if decode else None,
                llama_bench_ms_per_token=bench.get(name, {}).get("ms_per_token"),
                paired_vs_llama_bench=paired(ps, list(turns)),
            )
        )
    return rows


def print_table(
    rows: list[dict[str, Any]], args: argparse.Namespace, turns: list[float] = ()
) -> None:
    print(f"\none request, {args.max_tokens} tokens, {args.dtype} (jaxcb, vLLM), medians")
    head = f"{'system':<20}{'weights':>10}{'wall ms/tok':>13}{'decode ms/tok':>15}"
    head += f"{'tok/s':>8}{'llama-bench ms/tok':>20}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        per_token = r["decode_ms_per_token"] or r["wall_ms_per_token"]
        decode = f"{r['decode_ms_per_token']:.2f}" if r["decode_ms_per_token"] else "-"
        bench = r["llama_bench_ms_per_token"]
        print(
            f"{r['system']:<20}{r['precision']:>10}{r['wall_ms_per_token']:>13.2f}{decode:>15}"
            f"{1e3 / per_token:>8.1f}{f'{bench:.2f}' if bench else '-':>20}"
        )
    print("(tok/s from decode ms/tok where the system reports it, else from wall ms/tok)")
    if turns:
        print(
            f"\nllama-bench turns on {args.llama_bench_gguf.name}: "
            + ", ".join(f"{t:.1f}" for t in turns)
            + " tok/s"
        )
        for r in rows:
            p = r["paired_vs_llama_bench"]
            print(
                f"{r['system']} / llama-bench, paired by round: {p['median']:.3f}x median "
                f"({p['min']:.3f}-{p['max']:.3f}, {len(turns)} rounds)"
            )


def print_limits(
    rows: list[dict[str, Any]], limits: list[float], read_bytes: int | None, llama_share
) -> None:
    """Each system's decode rate as a share of the memory's read limit, round by round."""
    if not limits:
        return
    print(
        "\nread limit (native probe, start of each round): "
        + ", ".join(f"{lim / 1e9:.1f}" for lim in limits)
        + f" GB/s; a token reads {read_bytes / 1e6:.1f} MB of weights"
    )
    shares = [(r["system"], r["share_of_read_limit"]) for r in rows]
    if llama_share:
        shares.append(("llama-bench", llama_share))
    for name, p in shares:
        print(
            f"{name}: {100 * p['median']:.1f}% of the round's limit, median "
            f"({100 * p['min']:.1f}-{100 * p['max']:.1f}%, {len(limits)} rounds)"
        )
