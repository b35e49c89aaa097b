"""Batch inference over Ray actors: one jaxcb engine per actor, fed continuously, with a dead
actor's unfinished requests retried on another.

`RayEngine` stands behind the same `Engine` interface as `LLMEngine` and `ReplicatedEngine`,
so `jaxcb.offline.batch.run_batch` drives it unchanged: the reader, the ordering, the one writer in
the driver process and with it every restart-and-resume guarantee (ids already in the output
are skipped; a result is written once, when its request finishes) hold as they do in one
process. What differs is below `add_request`:

- requests wait in a driver-side queue and go out in batches of `batch_size`; each actor has
  at most `batches_per_replica` batches outstanding, and the next batch goes to the actor with
  the fewest. An actor that finishes early gets more work: nothing is split ahead of time.
- inside an actor (`EngineActor`) every outstanding batch shares one engine, stepped by one
  thread, so the engine batches continuously across batch boundaries; a call returns when
  all of its batch's requests are finished.
- an actor that dies (its process killed, its node lost) fails its outstanding calls with a
  RayActorError (an actor whose engine fails is ended, alike); their requests go back to the
  head of the queue (`num_retried` counts them) and another actor runs them. The dead actor
  is replaced by a new one (up to `max_restarts` times in all), which takes work once its
  engine is built.

Nothing an actor computed reaches the output file before the driver writes it, so a result
is written once whichever actor computed it, and a killed driver loses only unfinished work,
as before. Ray is imported here only, lazily: jaxcb works without it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxcb.config import EngineConfig
from jaxcb.engine.interface import Engine, EngineInfo, KVUsage, SpecDecodeCounts, StepRecord
from jaxcb.engine.validation import check_params, check_prompt_length, encode_prompt
from jaxcb.outputs import RequestOutput
from jaxcb.ray_support import actor_env, import_ray
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Batch = list[tuple[str, list[int], SamplingParams]]


class EngineActor:
    """One engine in an actor process. `run` may be called concurrently (a threaded actor):
    each call adds its batch to the shared engine and waits for it; one thread steps."""

    def __init__(self, config: EngineConfig) -> None:
        from jaxcb.build import build_engine

        self.engine = build_engine(config)
        self._cond = threading.Condition()
        self._done: dict[str, RequestOutput] = {}
        self._failure: str | None = None  # why the stepping thread stopped
        self._thread = threading.Thread(target=self._loop, name="jaxcb-ray-step", daemon=True)
        self._thread.start()

    def ready(self) -> tuple[EngineInfo, bool, int]:
        """(engine info, whether it has a tokenizer, this process's id): after the build."""
        return self.engine.info, self.engine.tokenizer is not None, os.getpid()

    def run(self, batch: Batch) -> list[RequestOutput]:
        """Finished outputs of every request in `batch` (an error output for one the engine
        rejects)."""
        ids = []
        with self._cond:
            for request_id, prompt_ids, params in batch:
                try:
                    self.engine.add_request(request_id, prompt_ids, params, final_only=True)
                except ValueError as exc:
                    self._done[request_id] = RequestOutput(
                        request_id, None, prompt_ids, [], True, error=f"ValueError: {exc}"
                    )
                ids.append(request_id)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._failure or all(i in self._done for i in ids))
            if self._failure:
                raise RuntimeError(f"the engine failed: {self._failure}")
            return [self._done.pop(i) for i in ids]

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return self.engine.stats()

    def kv_usage(self) -> KVUsage:
        with self._cond:
            return self.engine.kv_usage()

    def spec_decode_counts(self) -> SpecDecodeCounts:
        with self._cond:
            return self.engine.spec_decode_counts()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self.engine.has_unfinished_requests)
                try:
                    finished = [out for out in self.engine.step() if out.finished]
                except Exception as exc:  # every call fails; the driver replaces this actor
                    self._failure = f"{type(exc).__name__}: {exc}"
                    self._cond.notify_all()
                    return
                for out in finished:
                    self._done[out.request_id] = out
                if finished:
                    self._cond.notify_all()


@dataclass(eq=False)  # compared by identity
class _Replica:
    actor: Any
    ready_ref: Any | None  # the pending `ready` call while the engine builds
    pid: int = 0
    outstanding: dict[Any, Batch] = field(default_factory=dict)  # ObjectRef -> its batch


class RayEngine(Engine):
    """`num_replicas` engines in Ray actors behind the Engine interface (module docstring).
    Starts a local Ray (loopback, `num_replicas * num_cpus_per_replica` CPUs) unless Ray is
    already initialized or `address` names a cluster."""

    def __init__(
        self,
        config: EngineConfig,
        num_replicas: int,
        *,
        address: str | None = None,
        num_cpus_per_replica: int = 1,
        num_gpus_per_replica: float = 0,
        batch_size: int | None = None,
        batches_per_replica: int = 3,
        max_restarts: int = 4,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if batches_per_replica < 1:
            raise ValueError(f"batches_per_replica must be >= 1, got {batches_per_replica}")
        if getattr(config.parallel, "distributed", False):
            raise ValueError(
                "--ray runs independent engines, --distributed one engine over several "
                "processes: pick one"
            )
        address = address or os.environ.get("RAY_ADDRESS")  # set inside a Ray job
        ray = self._ray = import_ray(loopback=address is None)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            if address is None:  # a private local cluster on loopback
                ray.init(
                    num_cpus=num_replicas * num_cpus_per_replica,
                    include_dashboard=False,
                    log_to_driver=False,
                    _node_ip_address="127.0.0.1",
                )
            else:
                ray.init(address=address, log_to_driver=False)
        self.config = config
        self.batch_size = batch_size or max(1, config.scheduler.max_num_seqs // 2)
        self.batches_per_replica = batches_per_replica
        self.restarts_left = max_restarts
        # requests worth keeping in the driver (queued + sent): twice what the actors hold
        self.suggested_in_flight = 2 * num_replicas * batches_per_replica * self.batch_size
        self.num_retried = 0  # requests sent again after their actor died
        self.num_actor_deaths = 0
        self._actor_cls = ray.remote(
            num_cpus=num_cpus_per_replica,
            num_gpus=num_gpus_per_replica,
            max_concurrency=batches_per_replica + 2,
            runtime_env={"env_vars": actor_env(num_cpus_per_replica)},
        )(EngineActor)
        self._queue: collections.deque[tuple[str, list[int], SamplingParams]] = collections.deque()
        self._replicas = [self._start_replica() for _ in range(num_replicas)]
        # wait for every engine (built in parallel): a run starts with all of them
        ready = ray.get([r.ready_ref for r in self._replicas])
        for replica, (_, _, pid) in zip(self._replicas, ready, strict=True):
            replica.ready_ref, replica.pid = None, pid
        info, has_tokenizer, _ = ready[0]
        self.info: EngineInfo = info
        self.tokenizer = None
        if has_tokenizer:
            from jaxcb.models.loading.loader import load_tokenizer

            self.tokenizer = load_tokenizer(Path(config.tokenizer or info.model_path))

    # ---- actors -------------------------------------------------------------------------

    def _start_replica(self) -> _Replica:
        actor = self._actor_cls.remote(self.config)
        return _Replica(actor, actor.ready.remote())

    def _ready(self) -> list[_Replica]:
        return [r for r in self._replicas if r.ready_ref is None]

    def actor_pids(self) -> list[int]:
        """Process ids of the actors whose engine is built (for tests and benchmarks)."""
        return [r.pid for r in self._ready()]

    def _replace(self, replica: _Replica, error: Exception) -> None:
        """`replica`'s actor died: requeue its outstanding batches, start a new one."""
        self.num_actor_deaths += 1
        lost = [req for batch in replica.outstanding.values() for req in batch]
        self.num_retried += len(lost)
        self._queue.extendleft(reversed(lost))
        logger.warning(
            "a Ray actor died (%s): %d requests go to another; %d restarts left",
            type(error).__name__,
            len(lost),
            self.restarts_left,
        )
        self._replicas.remove(replica)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self._replicas.append(self._start_replica())
        if not self._replicas:
            raise RuntimeError("every Ray actor died and no restarts are left")

    # ---- requests -----------------------------------------------------------------------

    def validate_request(
        self, prompt: str | Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        check_params(params, priority, self.config)
        prompt_text, prompt_ids = encode_prompt(prompt, self.tokenizer, self.info.vocab_size)
        check_prompt_length(len(prompt_ids), self.max_model_len, self.config.limits)
        return prompt_text, prompt_ids

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        final_only: bool = False,
    ) -> str:
        """Validate here, queue for an actor. Only final outputs come back (`final_only` is
        implied): streaming partial tokens across processes is not what batch work needs."""
        if request_id is None:
            raise ValueError("RayEngine needs explicit request ids")
        params = params or SamplingParams()
        _, prompt_ids = self.validate_request(prompt, params, priority=priority)
        self._queue.append((str(request_id), prompt_ids, params))
        return str(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drops a queued request; one already sent runs on (its actor ends with the run)."""
        for i, (rid, _, _) in enumerate(self._queue):
            if rid == request_id:
                del self._queue[i]
                break
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue) or any(r.outstanding for r in self._replicas)

    @property
    def num_running(self) -> int:
        return sum(len(b) for r in self._replicas for b in r.outstanding.values())

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    # ---- one step -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self._queue:
            ready = [r for r in self._ready() if len(r.outstanding) < self.batches_per_replica]
            if not ready:
                return
            replica = min(ready, key=lambda r: len(r.outstanding))
            n = min(self.batch_size, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            replica.outstanding[replica.actor.run.remote(batch)] = batch

    def step(self) -> list[RequestOutput]:
        """Send out queued work, wait for some to come back (or an actor to become ready or
        die); the finished outputs."""
        ray = self._ray
        self._dispatch()
        owner = {ref: r for r in self._replicas for ref in r.outstanding}
        owner.update({r.ready_ref: r for r in self._replicas if r.ready_ref is not None})
        if not owner:
            return []
        done, _ = ray.wait(list(owner), num_returns=1, timeout=1.0)
        outputs: list[RequestOutput] = []
        for ref in done:
            replica = owner[ref]
            try:
                result = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                if replica in self._replicas:
                    self._replace(replica, exc)
                continue
            except ray.exceptions.RayTaskError as exc:  # its engine failed: end it too
                if replica in self._replicas:
                    ray.kill(replica.actor, no_restart=True)
                    self._replace(replica, exc)
                continue
            if ref is replica.ready_ref:
                replica.ready_ref, replica.pid = None, result[2]
            else:
                del replica.outstanding[ref]
                outputs.extend(result)
        self._dispatch()
        return outputs

    # ---- introspection ------------------------------------------------------------------

    def _gather(self, method: str) -> list[Any]:
        ray = self._ray
        return ray.get([getattr(r.actor, method).remote() for r in self._ready()])

    def stats(self) -> dict[str, Any]:
        """Each actor's stats under "replicas", the counters summed, and the retries."""
        per_replica = self._gather("stats")
        total: dict[str, Any] = {
            key: sum(s[key] for s in per_replica)
            for key, value in (per_replica[0].items() if per_replica else ())
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        total.update(
            replicas=per_replica,
            num_replicas=len(self._replicas),
            retried_requests=self.num_retried,
            actor_deaths=self.num_actor_deaths,
        )
        return total

    def kv_usage(self) -> KVUsage:
        usages = self._gather("kv_usage")
        return KVUsage(*(sum(getattr(u, f) for u in usages) for f in KVUsage.__dataclass_fields__))

    def spec_decode_counts(self) -> SpecDecodeCounts:
        counts = self._gather("spec_decode_counts")
        return SpecDecodeCounts(
            *(sum(getattr(c, f) for c in counts) for f in SpecDecodeCounts.__dataclass_fields__)
        )

    def record_steps(self, on: bool = True) -> None:
        """Step records stay in the actors: not collected across processes."""

    def pop_step_records(self) -> list[StepRecord]:
        return []

    def check_page_invariant(self) -> None:
        """Each actor's engine checks its own pool; nothing to check from here."""

    def check_health(self) -> None:
        if not self._replicas:
            raise RuntimeError("no Ray actor is left")

    def reset_prefix_cache(self) -> int:
        return 0

    def close(self) -> None:
        """Kill the actors (their unfinished work is lost, as with a crash: the output file
        has every result written so far); shut Ray down if this engine started it."""
        ray = self._ray
        for replica in self._replicas:
            ray.kill(replica.actor, no_restart=True)
        self._replicas = []
        if self._started_ray:
            ray.shutdown()


def add_ray_args(parser: Any) -> None:
    """scripts/batch_infer.py's Ray flags."""
    group = parser.add_argument_group('Ray (pip install "jaxcb[ray]")')
    group.add_argument(
        "--ray",
        action="store_true",
        help="run the engines in Ray actors, one engine each, fed continuously; a dead "
        "actor's unfinished requests are retried on another (jaxcb/offline/ray_batch.py)",
    )
    group.add_argument(
        "--num-replicas", type=int, default=2, help="Ray actors, one engine each (default: 2)"
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="a running cluster's address (ray://host:10001 or auto); default: start a "
        "local one on loopback with --num-replicas x --ray-cpus-per-replica CPUs",
    )
    group.add_argument(
        "--ray-cpus-per-replica", type=int, default=1, help="CPUs each actor reserves (1)"
    )
    group.add_argument(
        "--ray-gpus-per-replica", type=float, default=0, help="GPUs each actor reserves (0)"
    )


def ray_engine_from_args(config: EngineConfig, args: Any) -> RayEngine:
    """The RayEngine that `add_ray_args`'s flags describe (ImportError without Ray)."""
    return RayEngine(
        config,
        args.num_replicas,
        address=args.ray_address,
        num_cpus_per_replica=args.ray_cpus_per_replica,
        num_gpus_per_replica=args.ray_gpus_per_replica,
    )
