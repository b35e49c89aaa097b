"""What tensor parallelism across processes costs: a decode step and an isolated all-reduce,
over N local processes joined by jax.distributed (gloo on CPU) vs N devices in one process.

    python -m jaxcb.bench distributed                      # 2 processes, a random model
    python -m jaxcb.bench distributed --processes 4 --hidden 512 4096
    python -m jaxcb.bench distributed --model /path/to/hf_model --processes 2

It starts the N processes of the job on a loopback coordinator (one CPU device each, tensor
parallel over all of them), then one process with N forced CPU devices, and prints both:
the median decode step of `--batch` sequences (engine.step(), host work included, over
--steps steps), and the median all-reduce of a [hidden] float32 vector per device (a jitted
psum over the tensor axis, dispatch included, --repeats calls; the same call without the psum
is the dispatch alone). The engine's
step makes two such all-reduces per layer (after attention and after the MLP) of
[tokens, hidden], and one all-gather of the logits.

The default model is a random llama (hidden 512, 8 KV heads, 4 layers; its weights do not
matter to timing) written to a temporary directory; --model takes any model jaxcb loads
whose KV heads N divides. --json writes both runs' figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.timing import time_calls

DESCRIPTION = "tensor parallelism across processes: a decode step and an all-reduce, N vs 1"
FLAGS = SharedFlags(
    repeats=300,
    repeats_help="all-reduces timed per size",
    repeats_alias="--iters",
    model=True,
    model_help="any model jaxcb loads whose KV heads N divides (default: a random llama)",
)

BENCH_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=1024,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--processes", type=int, default=2, help="N (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="decoding sequences")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed")
    parser.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=None,
        help="all-reduce vector sizes (default: the model's hidden size)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    # internal: one process of a run
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.worker and args.processes < 2:
        parser.error(f"--processes must be >= 2, got {args.processes}")


# ---- one process of a run ---------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Time the decode step and the all-reduce in this process (all processes of a run do
    the same calls in the same order: multi-controller SPMD)."""
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np

    from jaxcb import LLM, SamplingParams

    tp = args.num_processes * args.devices
    distributed: dict[str, Any] = {}
    if args.num_processes > 1:
        distributed = dict(
            distributed=True,
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    batch, prompt_len = args.batch, 8
    llm = LLM(
        args.model,
        tensor_parallel_size=tp,
        attention="xla",
        matmul="xla",
        max_model_len=256,
        page_size=16,
        max_num_seqs=batch,
        max_num_batched_tokens=batch * prompt_len,
        token_buckets=sorted({batch, batch * prompt_len}),
        seq_buckets=[batch],
        num_pages=batch * 4 + 4,
        **distributed,
    )
    engine = llm.engine
    warm = 5
    params = SamplingParams(max_tokens=warm + args.steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [3 + (i + j) % 200 for j in range(prompt_len)], params)
    # the first call is the prefill, then `warm` decode steps untimed
    steps = time_calls(engine.step, iters=args.steps, warmup=warm).seconds
    while engine.has_unfinished_requests():
        engine.step()

    from jax.sharding import NamedSharding, PartitionSpec

    from jaxcb.runtime import sharding

    mesh = sharding.replica_mesh(tp)
    spec = PartitionSpec(sharding.TENSOR_AXIS)
    hidden_sizes = args.hidden or [engine.runner.spec.hidden_size]
    allreduce: dict[str, dict[str, float]] = {}
    for hidden in hidden_sizes:
        # one [hidden] row per device, each process giving only its own devices' rows
        x = jax.make_array_from_callback(
            (tp, hidden),
            NamedSharding(mesh, spec),
            lambda index, h=hidden: np.ones((tp, h), np.float32)[index],
        )

        def psum(a: Any) -> Any:
            return jax.lax.psum(a, sharding.TENSOR_AXIS)

        timings = {}
        for name, body in (("allreduce", psum), ("dispatch", lambda a: a * 1.0)):
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
            # 10 untimed calls: the compile, then 9
            timings[name] = time_calls(f, (x,), iters=args.repeats, warmup=9).median * 1e6
        allreduce[str(hidden)] = timings
    return {
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "tensor_parallel_size": tp,
        "decode_step_ms": statistics.median(steps) * 1e3,
        "decode_step_ms_p90": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3,
        "allreduce_us": allreduce,
    }


# ---- the launcher -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, model: str, processes: int, devices: int) -> dict[str, Any]:
    """Start one run's processes, wait for them, return process 0's figures."""
    port = free_port()
    base = [sys.executable, "-m", "jaxcb.bench", "distributed", "--worker", "--model", model]
    base += ["--batch", str(args.batch), "--steps", str(args.steps)]
    base += ["--repeats", str(args.repeats)]
    base += ["--num-processes", str(processes), "--devices", str(devices), "--port", str(port)]
    if args.hidden:
        base += ["--hidden", *map(str, args.hidden)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [*base, "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                raise SystemExit(
                    f"distributed: error: a process exited {proc.returncode}: "
                    f"{err.strip().splitlines()[-1] if err.strip() else ''}"
                )
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results[0]


def write_bench_model(path: Path) -> None:
    from jaxcb.models.loading.default_model import CONFIG, write_random_llama

    write_random_llama(path, dict(CONFIG, **BENCH_CONFIG), seed=0, std=0.2)


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    if args.worker:  # one process of a run: its figures, the last line of its stdout
        print(json.dumps(worker(args)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "model")
            write_bench_model(Path(model))
        n = args.processes
        across = launch(args, model, processes=n, devices=1)
        within = launch(args, model, processes=1, devices=n)
    record |= {
        "tensor_parallel_size": n,
        "batch": args.batch,
        f"{n}_processes": across,
        f"1_process_{n}_devices": within,
    }
    print(f"TP {n}, decode batch {args.batch}")
    print(f"{'':28s}{'decode step ms (p90)':>22s}  all-reduce us [hidden]: psum / dispatch alone")
    for name, r in ((f"{n} processes x 1 device", across), (f"1 process x {n} devices", within)):
        step = f"{r['decode_step_ms']:.2f} ({r['decode_step_ms_p90']:.2f})"
        reduces = "  ".join(
            f"[{h}] {t['allreduce']:.0f} / {t['dispatch']:.0f}"
            for h, t in r["allreduce_us"].items()
        )
        print(f"{name:28s}{step:>22s}  {reduces}")
