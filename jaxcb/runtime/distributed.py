"""Multi-process jax (`parallel.distributed`): joining the job, and leaving it cleanly when a
peer fails.

jaxcb runs multi-controller SPMD: every process runs the same engine loop on the same
requests, its scheduler (host-side and deterministic) makes the same decisions, and each
process drives its own devices of one mesh that spans them all. The processes meet only
inside the step's collectives (and the few broadcasts batch inference makes). That is why a
failure needs care: a collective whose peer has gone either fails at once (the peer's
sockets were closed: gloo reports a reset) or waits for it forever (a frozen process, a host
that vanished from the network), and on the way out jax's shutdown barrier waits for the
dead peer too, then aborts with a page of stack trace.

So, once jax.distributed is up, jaxcb
- runs a `PeerWatchdog`: a daemon thread that writes this process's heartbeat into the
  coordination service's key-value store every `interval` seconds and reads every peer's;
  a peer silent for `timeout` seconds (or a coordinator unreachable that long) ends this
  process with a one-line error (`fail`);
- wraps the points where the host waits on a collective (`collective`): a runtime error there
  means a peer has gone, and ends the process the same way at once.

`fail` uses `os._exit(1)`: nothing can be recovered once the processes of one program are out
of step, and a normal exit would wait in jax's shutdown barrier for the dead peer. jax's own
heartbeat (which aborts the process) is set to a longer timeout than the watchdog's, as a
backstop.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxcb.config import EngineConfig, ParallelConfig
from jaxcb.runtime.platforms import restrict_to_present_hardware

logger = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "jaxcb/heartbeat/"  # the key-value directory of the watchdogs' heartbeats
EXIT_CODE = 1

_watchdog: PeerWatchdog | None = None


def setup_distributed(parallel: ParallelConfig) -> None:
    """Before any device is touched: the platforms jax may start (the CPU alone where there
    is no accelerator), then jax.distributed if the config asks for it."""
    restrict_to_present_hardware()
    if parallel.distributed:
        initialize_distributed(
            coordinator_address=parallel.coordinator_address,
            num_processes=parallel.num_processes,
            process_id=parallel.process_id,
            heartbeat_timeout_s=parallel.heartbeat_timeout_s,
        )


def initialize_distributed(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: float = 60.0,
) -> None:
    """`jax.distributed.initialize` once per process, before any other jax call, then the
    peer watchdog (`heartbeat_timeout_s`: how long a silent peer is waited for).

    On a TPU pod slice (and under SLURM, Open MPI or Kubernetes) every address argument may
    be None: jax finds them in the environment. Elsewhere (multi-GPU hosts, several
    processes on one machine) give all three, or set JAX_COORDINATOR_ADDRESS and give the
    other two. CPU devices of different processes talk through gloo (TCP), which must be
    chosen before the CPU backend starts.
    """
    if not heartbeat_timeout_s > 0:
        raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
    if jax.distributed.is_initialized():
        start_watchdog(heartbeat_timeout_s)
        return
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None:
        # (jax's default since 0.4.3x; unset, CPU devices have no cross-process collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    # jax's heartbeat aborts the process: a backstop, later than the watchdog's clear error.
    backstop = jax_heartbeat_seconds(heartbeat_timeout_s)
    accepted = inspect.signature(jax.distributed.initialize).parameters
    if "heartbeat_timeout_seconds" in accepted:
        kwargs["heartbeat_timeout_seconds"] = backstop
    jax.distributed.initialize(**kwargs)
    logger.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    start_watchdog(heartbeat_timeout_s)


def multi_controller_config(config: EngineConfig) -> EngineConfig:
    """`config` with what would make the processes of a multi-process job schedule
    differently turned off (a warning each), or a one-line ValueError; unchanged in a single
    process.

    Every process runs its own scheduler and they must agree step by step, so no decision
    may depend on the wall clock: the ITL controller (it times each step) is switched off,
    which leaves the fixed budget of max_num_batched_tokens; preemption by swap (its host
    pool would need every process's shards, and `auto` weighs measured bandwidths) becomes
    recompute, which gives the same tokens; and edf, which orders by wall-clock deadlines,
    is refused (fcfs, priority and srpf count steps, not seconds). async_scheduling stays
    as asked: it changes when tokens are read, not what is scheduled."""
    if jax.process_count() == 1:
        return config
    sched, changes = config.scheduler, {}
    if sched.scheduling_policy == "edf":
        raise ValueError(
            "scheduling_policy='edf' orders requests by wall-clock deadlines, which differ "
            f"between the {jax.process_count()} processes of a distributed job: use fcfs, "
            "priority or srpf"
        )
    if sched.itl_target_ms is not None:
        changes["itl_target_ms"] = None
        logger.warning(
            "itl_target_ms=%s is off in a distributed job (the ITL controller times steps, "
            "and every process must schedule alike): prefill budget max_num_batched_tokens",
            sched.itl_target_ms,
        )
    if sched.preemption_mode != "recompute":
        changes["preemption_mode"] = "recompute"
        logger.warning(
            "preemption_mode=%r is recompute in a distributed job (the host swap pool holds "
            "one process's pages only); preempted requests give the same tokens",
            sched.preemption_mode,
        )
    return config.replace(**changes) if changes else config


def jax_heartbeat_seconds(timeout_s: float) -> int:
    """jax's own heartbeat timeout for a watchdog timeout: twice it and 10 s more, so that
    the watchdog's one-line error comes first."""
    return math.ceil(2 * timeout_s) + 10


def start_watchdog(timeout_s: float) -> PeerWatchdog | None:
    """The process's PeerWatchdog, started once (None: a single process, nothing to watch)."""
    global _watchdog
    if jax.process_count() == 1 or _distributed_client() is None:
        return None
    if _watchdog is None:
        _watchdog = PeerWatchdog(
            _distributed_client(), jax.process_index(), jax.process_count(), timeout_s
        )
        _watchdog.start()
        # Stop it before the interpreter ends: a daemon thread still inside a key-value call
        # at finalization is torn down mid-C++ and aborts the process. (Registered after
        # jax's own exit handler, so it runs first: before jax.distributed.shutdown.)
        atexit.register(_watchdog.stop)
    return _watchdog


def fail(message: str) -> None:
    """End this process of a multi-process job with a one-line error (exit status 1).

    os._exit: the other processes cannot go on without this one's devices, and a normal exit
    would first wait in jax's shutdown barrier for a peer that may be dead."""
    where = f"process {jax.process_index()} of {jax.process_count()}"
    with contextlib.suppress(Exception):  # a closed stdout must not keep the process alive
        sys.stdout.flush()
    os.write(2, f"jaxcb: error: {where}: {message}\n".encode())
    os._exit(EXIT_CODE)


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Around a host wait on a collective (reading a step's results, a broadcast): in a
    multi-process job, a runtime error there means a peer has gone (a closed connection, a
    failed all-reduce), so the process ends with a one-line error rather than a traceback
    and a hang in the shutdown barrier. One process: errors pass through unchanged."""
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        if jax.process_count() == 1:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"{what} failed, a peer process has likely died: {first}")


def _distributed_client() -> Any:
    """jax's coordination-service client (None before jax.distributed.initialize). jax has
    no public accessor for it; multihost_utils reads the same attribute."""
    from jax._src import distributed as jax_distributed

    return getattr(jax_distributed.global_state, "client", None)


class PeerWatchdog:
    """A heartbeat of this process and a check of every peer's, through the coordination
    service's key-value store (module docstring).

    Two daemon threads: one makes the key-value calls (which may block when the coordinator
    is gone), the other only compares clocks, so a blocked call cannot hide a failure. A
    heartbeat is a counter under HEARTBEAT_PREFIX + process index; one directory read per
    beat gets all of them. Time counts from the start for a peer not yet heard from.
    """

    def __init__(
        self,
        client: Any,
        process_index: int,
        process_count: int,
        timeout_s: float,
        *,
        on_failure: Callable[[str], None] = fail,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"heartbeat timeout must be > 0, got {timeout_s}")
        self.client = client
        self.index, self.count = process_index, process_count
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 10)
        self.on_failure, self.clock = on_failure, clock
        now = clock()
        self._lock = threading.Lock()
        self._beats: dict[int, str] = {}  # peer -> its last counter seen
        self._heard: dict[int, float] = {p: now for p in self.peers}  # peer -> when it changed
        self._reached = now  # when the coordinator last answered
        self._counter = 0  # this process's heartbeat
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat_loop, name="jaxcb-heartbeat", daemon=True),
            threading.Thread(target=self._check_loop, name="jaxcb-watchdog", daemon=True),
        ]

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.count) if p != self.index]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        logger.info(
            "peer watchdog: process %d, heartbeat every %.1fs, peers silent %.0fs end the job",
            self.index,
            self.interval_s,
            self.timeout_s,
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop both threads and wait for them (a key-value call in flight returns first)."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout_s)

    def beat(self) -> None:
        """Write this process's heartbeat and read the peers' (one round trip each)."""
        self._counter += 1
        self.client.key_value_set(
            f"{HEARTBEAT_PREFIX}{self.index}", str(self._counter), allow_overwrite=True
        )
        entries = self.client.key_value_dir_get(HEARTBEAT_PREFIX)
        now = self.clock()
        with self._lock:
            self._reached = now
            for key, value in entries:
                peer = int(key.rsplit("/", 1)[-1])
                if peer != self.index and self._beats.get(peer) != value:
                    self._beats[peer] = value
                    self._heard[peer] = now

    def check(self) -> str | None:
        """Why the job cannot go on (a peer or the coordinator silent too long), or None."""
        now = self.clock()
        with self._lock:
            if now - self._reached > self.timeout_s:
                return (
                    f"the coordinator (process 0) has not answered for {now - self._reached:.0f}s "
                    f"(heartbeat_timeout_s={self.timeout_s:g}): it has likely died"
                )
            silent = [p for p in self.peers if now - self._heard[p] > self.timeout_s]
        if silent:
            names = ", ".join(map(str, silent))
            return (
                f"process {names} sent no heartbeat for {self.timeout_s:g}s "
                "(heartbeat_timeout_s): dead or hung"
            )
        return None

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not jax.distributed.is_initialized():
                return  # jax.distributed.shutdown(): the job is over
            try:
                self.beat()
            except Exception as exc:  # an unreachable coordinator: check() decides
                logger.debug("heartbeat failed: %s", exc)

    def _check_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not jax.distributed.is_initialized():
                return
            reason = self.check()
            if reason is not None:
                self.on_failure(reason)
                return
