"""What tensor parallelism across processes costs: a decode step and an isolated all-reduce,
over N local processes joined by jax.distributed (gloo on CPU) vs N devices in one process.

    python scripts/bench_distributed.py                      # 2 processes, a random model
    python scripts/bench_distributed.py --processes 4 --hidden 512 4096
    python scripts/bench_distributed.py --model /path/to/hf_model --processes 2

It starts the N processes of the job on a loopback coordinator (one CPU device each, tensor
parallel over all of them), then one process with N forced CPU devices, and prints both:
the median decode step of `--batch` sequences (engine.step(), host work included), and
the median all-reduce of a [hidden] float32 vector per device (a jitted psum over the tensor
axis, dispatch included; the same call without the psum is the dispatch alone). The engine's
step makes two such all-reduces per layer (after attention and after the MLP) of
[tokens, hidden], and one all-gather of the logits.

The default model is a random llama (hidden 512, 8 KV heads, 4 layers; its weights do not
matter to timing) written to a temporary directory; --model takes any model jaxcb loads
whose KV heads N divides.
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
import time
from pathlib import Path
from typing import Any

BENCH_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=1024,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=2, help="N (default: %(default)s)")
    parser.add_argument("--model", default=None, help="default: a random llama (docstring)")
    parser.add_argument("--batch", type=int, default=8, help="decoding sequences")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed")
    parser.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=None,
        help="all-reduce vector sizes (default: the model's hidden size)",
    )
    parser.add_argument("--iters", type=int, default=300, help="all-reduces timed per size")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    # internal: one process of a run
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    return parser


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
    engine.step()  # the prefill
    for _ in range(warm):
        engine.step()
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
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
            for _ in range(10):
                f(x).block_until_ready()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                f(x).block_until_ready()
                times.append(time.perf_counter() - t0)
            timings[name] = statistics.median(times) * 1e6
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


def run(args: argparse.Namespace, model: str, processes: int, devices: int) -> dict[str, Any]:
    """Start one run's processes, wait for them, return process 0's figures."""
    port = free_port()
    base = [sys.executable, __file__, "--worker", "--model", model]
    base += ["--batch", str(args.batch), "--steps", str(args.steps), "--iters", str(args.iters)]
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
                    f"bench_distributed.py: error: a process exited {proc.returncode}: "
                    f"{err.strip().splitlines()[-1] if err.strip() else ''}"
                )
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def write_bench_model(path: Path) -> None:
    from jaxcb.models.loading.default_model import CONFIG, write_random_llama

    write_random_llama(path, dict(CONFIG, **BENCH_CONFIG), seed=0, std=0.2)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.processes < 2:
        parser.error(f"--processes must be >= 2, got {args.processes}")
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "model")
            write_bench_model(Path(model))
        n = args.processes
        across = run(args, model, processes=n, devices=1)
        within = run(args, model, processes=1, devices=n)
    report = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "tensor_parallel_size": n,
        "batch": args.batch,
        f"{n}_processes": across,
        f"1_process_{n}_devices": within,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"CPU: {report['cpu']} ({report['cores']} cores); TP {n}, decode batch {args.batch}")
    print(f"{'':28s}{'decode step ms (p90)':>22s}  all-reduce us [hidden]: psum / dispatch alone")
    for name, r in ((f"{n} processes x 1 device", across), (f"1 process x {n} devices", within)):
        step = f"{r['decode_step_ms']:.2f} ({r['decode_step_ms_p90']:.2f})"
        reduces = "  ".join(
            f"[{h}] {t['allreduce']:.0f} / {t['dispatch']:.0f}"
            for h, t in r["allreduce_us"].items()
        )
        print(f"{name:28s}{step:>22s}  {reduces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
