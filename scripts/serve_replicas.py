"""N jaxcb servers behind one OpenAI-compatible endpoint, routed by prompt prefix.

    python scripts/serve_replicas.py --num-replicas 2 --port 8000 --routing prefix \\
        --config configs/tiny-cpu.yaml            # any other flag goes to each serve.py

Starts `--num-replicas` copies of scripts/serve.py as subprocesses on loopback ports
(--replica-base-port, +1, ...), each with its share of the CPU threads (--cpus-per-replica),
waits until every one answers /health, then serves the router (jaxcb/server/router.py) on
--host:--port. Routing: prefix (a prompt prefix goes to the replica that served it
recently; else the least-loaded), least-loaded, or round-robin. A replica whose process
exits is restarted and kept out of rotation until its /health answers again. Ctrl-C stops the
router and every replica. GET /metrics: every replica's metrics labelled replica="i";
GET /router/stats: routing counts and health.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jaxcb.server.router import POLICIES, Router, build_router_app

SERVE = Path(__file__).resolve().with_name("serve.py")


class Replicas:
    """The serve.py subprocesses: started, restarted when they exit, stopped."""

    def __init__(self, ports: list[int], serve_args: list[str], cpus: int, log_dir: Path) -> None:
        self.ports, self.serve_args, self.cpus, self.log_dir = ports, serve_args, cpus, log_dir
        self.procs: list[subprocess.Popen | None] = [None] * len(ports)
        self.restarts = 0

    def start(self, index: int) -> None:
        env = dict(os.environ)
        if self.cpus:
            threads = str(self.cpus)
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
            if self.cpus == 1:
                flags = env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                env["XLA_FLAGS"] = (flags + " intra_op_parallelism_threads=1").strip()
        log = open(self.log_dir / f"replica{index}.log", "ab")  # noqa: SIM115
        command = [sys.executable, str(SERVE), *self.serve_args]
        command += ["--host", "127.0.0.1", "--port", str(self.ports[index])]
        self.procs[index] = subprocess.Popen(command, env=env, stdout=log, stderr=log)

    def restart_if_exited(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None and proc.poll() is not None:
            logging.warning("replica %d exited (%s): restarting it", index, proc.returncode)
            self.restarts += 1
            self.start(index)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for index, port in enumerate(self.ports):
            while True:
                proc = self.procs[index]
                if proc is not None and proc.poll() is not None:
                    raise SystemExit(f"serve_replicas.py: replica {index} exited; see its log "
                                     f"in {self.log_dir}")  # fmt: skip
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"serve_replicas.py: replica {index} not healthy "
                                         f"after {timeout:.0f}s") from None  # fmt: skip
                    time.sleep(0.5)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-replicas", type=int, default=2, help="serve.py processes (2)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (%(default)s)")
    p.add_argument(
        "--replica-base-port", type=int, default=None, help="replica i on this + i (PORT + 1)"
    )
    p.add_argument("--routing", choices=POLICIES, default="prefix", help="(%(default)s)")
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=256,
        help="prompt tokens (4x that in characters for text) that make the routing key "
        "(%(default)s)",
    )
    p.add_argument(
        "--max-imbalance",
        type=int,
        default=8,
        help="prefix routing leaves a replica with this many more requests in flight than "
        "the least-loaded one (%(default)s)",
    )
    p.add_argument("--cpus-per-replica", type=int, default=0, help="threads each (0: all)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds (%(default)s)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds (%(default)s)")
    p.add_argument("--log-dir", type=Path, default=Path("."), help="replicaN.log files (.)")
    p.add_argument(
        "--ray",
        action="store_true",
        help="place the replicas with Ray (jaxcb/ray_replicas.py): each server owned by an "
        "actor on any node of the cluster, a dead one replaced by a new actor",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with --ray: a running cluster's address (default: a private local cluster "
        "on loopback)",
    )
    p.add_argument("--gpus-per-replica", type=float, default=0, help="with --ray (0)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, serve_args = parser.parse_known_args(argv)
    if args.num_replicas < 1:
        parser.error(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if any(a in ("--host", "--port") for a in serve_args):
        parser.error("--host/--port are the router's; replicas take --replica-base-port")
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    if args.ray:
        from jaxcb.ray_replicas import RayReplicas

        try:
            replicas = RayReplicas(args.num_replicas, serve_args, address=args.ray_address,
                                   num_cpus=max(1, args.cpus_per_replica),
                                   num_gpus=args.gpus_per_replica)  # fmt: skip
        except ImportError as exc:
            parser.exit(2, f"serve_replicas.py: error: {exc}\n")
        addresses = list(replicas.addresses)
    else:
        base = args.replica_base_port or args.port + 1
        addresses = [("127.0.0.1", base + i) for i in range(args.num_replicas)]
        args.log_dir.mkdir(parents=True, exist_ok=True)
        replicas = Replicas([p for _, p in addresses], serve_args, args.cpus_per_replica,
                            args.log_dir)  # fmt: skip
        for i in range(args.num_replicas):
            replicas.start(i)
    ports = [p for _, p in addresses]
    try:
        replicas.wait_healthy(args.start_timeout)
        router = Router(
            addresses,
            policy=args.routing,
            prefix_tokens=args.prefix_tokens,
            max_imbalance=args.max_imbalance,
        )
        replicas.router_replicas = router.replicas  # a restarted Ray replica's new address
        app = build_router_app(
            router, health_interval=args.health_interval, on_unhealthy=replicas.restart_if_exited
        )
        import uvicorn

        print(f"router on http://{args.host}:{args.port} -> replicas on ports {ports}",
              file=sys.stderr, flush=True)  # fmt: skip
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except KeyboardInterrupt:
        pass
    finally:
        replicas.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
