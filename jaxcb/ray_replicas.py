"""Serving replicas placed by Ray: each jaxcb server (jaxcb.server.cli, what scripts/serve.py
runs) is a process owned by a Ray actor, on whichever node of the cluster Ray schedules it,
and the router (jaxcb/server/router.py) reaches it at the address the actor reports.

What Ray adds over scripts/serve_replicas.py's local subprocesses: placement on a cluster
(`--ray-address`: a real cluster's; none: a private local cluster on loopback), each replica's
CPU/GPU share as Ray resources, and a replica whose node or process dies brought back by
starting a new actor (the router's health check calls `restart_if_exited`). The server runs
as a child process of the actor, not inside it: it owns its event loop, its signals and its
jax runtime, exactly as serve.py does on its own.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from jaxcb.ray_support import actor_env, import_ray

logger = logging.getLogger(__name__)

#: what scripts/serve.py runs, without needing the script's path on every node
SERVE_CODE = "import sys; from jaxcb.server.cli import main; sys.exit(main())"


class ServerActor:
    """One jaxcb server process on this actor's node, on a free port of `host` (loopback
    for a local cluster, the node's address on a real one)."""

    def __init__(self, serve_args: list[str], loopback: bool) -> None:
        import ray

        self.host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as s:  # a free port on this node
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        command = [sys.executable, "-c", SERVE_CODE, *serve_args]
        command += ["--host", self.host, "--port", str(self.port)]
        self.proc = subprocess.Popen(command)

    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RayReplicas:
    """N ServerActors: started, health-waited, restarted when their server (or actor) is
    gone, stopped. `addresses` lists each replica's (host, port) for the router; a restarted
    replica keeps its index (its new address is set on the router's Replica)."""

    def __init__(
        self,
        num_replicas: int,
        serve_args: list[str],
        *,
        address: str | None = None,
        num_cpus: int = 1,
        num_gpus: float = 0,
    ) -> None:
        self.loopback = address is None
        ray = self._ray = import_ray(loopback=self.loopback)
        if not ray.is_initialized():
            if self.loopback:
                ray.init(num_cpus=num_replicas * num_cpus, include_dashboard=False,
                         log_to_driver=False, _node_ip_address="127.0.0.1")  # fmt: skip
            else:
                ray.init(address=address, log_to_driver=False)
        self.serve_args = serve_args
        self._cls = ray.remote(
            num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": actor_env(num_cpus)}
        )(ServerActor)
        self.actors = [self._start() for _ in range(num_replicas)]
        self.addresses = [tuple(ray.get(a.address.remote())) for a in self.actors]
        self.restarts = 0
        self.router_replicas: list[Any] = []  # the router's Replica objects, once it exists

    def _start(self) -> Any:
        return self._cls.remote(self.serve_args, self.loopback)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for index, (host, port) in enumerate(self.addresses):
            while True:
                try:
                    with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2):
                        break
                except OSError:
                    if not self._alive(index):
                        message = f"replica {index} (Ray actor) exited while starting"
                        raise SystemExit(message) from None
                    if time.monotonic() > deadline:
                        raise SystemExit(
                            f"replica {index} not healthy after {timeout:.0f}s"
                        ) from None
                    time.sleep(0.5)

    def _alive(self, index: int) -> bool:
        try:
            return bool(self._ray.get(self.actors[index].alive.remote(), timeout=10))
        except Exception:  # the actor (or its node) is gone: RayActorError and the like
            return False

    def restart_if_exited(self, index: int) -> None:
        """The router found replica `index` unhealthy: if its server or actor is gone, a new
        actor takes its place (on whichever node Ray picks) and the router its address."""
        if self._alive(index):
            return  # slow, not dead: the router keeps it out of rotation until it answers
        logger.warning("replica %d (Ray actor) is gone: starting a new one", index)
        with contextlib.suppress(Exception):
            self._ray.kill(self.actors[index])
        self.actors[index] = self._start()
        self.addresses[index] = tuple(self._ray.get(self.actors[index].address.remote()))
        if self.router_replicas:
            replica = self.router_replicas[index]
            replica.host, replica.port = self.addresses[index]
        self.restarts += 1

    def stop(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self._ray.get(actor.stop.remote(), timeout=30)
        if self.loopback:
            self._ray.shutdown()
