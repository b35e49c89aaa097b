"""Data parallelism: independent engine replicas behind the LLMEngine interface.

`make_engine(config)` is what `LLM` and the server build: one `LLMEngine` when
`data_parallel_size` is 1, else a `ReplicatedEngine` of that many, each on its own row of the
(data, tensor) device mesh (runtime/sharding.py), with its own KV pool, scheduler and
compiled buckets. Nothing is shared between replicas but the request stream:

- `add_request` sends a request to the least-loaded replica: fewest unfinished sequences
  (waiting + running), then fewest KV pages in use, then the lowest index;
- `step` steps every replica that has work, concurrently (one thread each: the device work
  of one overlaps the others', and jax releases the GIL while it waits), and returns their
  outputs together;
- request ids are unique across replicas; `abort_request` finds the owner.

Across hosts, run one job per host (or slice) instead: each process drives its own devices.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxcb.config import EngineConfig
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def make_engine(
    config: EngineConfig | None = None, *, compile_progress: bool = False
) -> LLMEngine | ReplicatedEngine:
    """One engine, or `data_parallel_size` replicas behind the same interface."""
    config = config or EngineConfig()
    if config.parallel.data_parallel_size == 1:
        return LLMEngine(config, compile_progress=compile_progress)
    return ReplicatedEngine(config, compile_progress=compile_progress)


class _PoolTotals:
    """The page-pool figures the server and stats read, summed over replicas."""

    def __init__(self, replicas: Sequence[LLMEngine]) -> None:
        self._replicas = replicas

    _SUMMED = ("num_pages", "num_used", "num_free", "num_cached", "num_evictable")
    _SUMMED += ("peak_used", "num_evictions")  # peaks of different moments: an upper bound

    def __getattr__(self, name: str) -> int:
        if name not in self._SUMMED:
            raise AttributeError(name)
        return sum(getattr(r.pool, name) for r in self._replicas)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages


class ReplicatedEngine:
    """`data_parallel_size` LLMEngines; see the module docstring."""

    def __init__(self, config: EngineConfig, *, compile_progress: bool = False) -> None:
        import jax

        from jaxcb.runtime import sharding

        parallel = config.parallel
        sharding.setup_distributed(parallel)
        if jax.process_count() > 1:
            raise ValueError(
                f"data_parallel_size={parallel.data_parallel_size} over "
                f"{jax.process_count()} processes: replicas are driven by one process; run one "
                "job per host with data_parallel_size counting that host's replicas"
            )
        mesh = sharding.device_mesh(parallel.data_parallel_size, parallel.tensor_parallel_size)
        self.config = config
        self.mesh = mesh
        self.replicas: list[LLMEngine] = []
        for i, replica_mesh in enumerate(sharding.replica_meshes(mesh)):
            # Distinct seeds: unseeded requests on two replicas must not draw alike.
            replica_config = config.replace(seed=config.seed + i)
            self.replicas.append(
                LLMEngine(
                    replica_config,
                    compile_progress=compile_progress,
                    devices=list(replica_mesh.devices.flat),
                )
            )
            logger.info("data-parallel replica %d on %s", i, list(replica_mesh.devices.flat))
        first = self.replicas[0]
        for name in (
            "spec",
            "tokenizer",
            "eos_token_ids",
            "model_path",
            "max_model_len",
            "page_size",
            "pages_per_seq",
            "buckets",
            "attention_backend",
            "matmul_backend",
            "kv_cache_dtype",
            "limits",
            "model_format",
        ):
            setattr(self, name, getattr(first, name))
        self.load_seconds = sum(r.load_seconds for r in self.replicas)
        self.num_pages = sum(r.num_pages for r in self.replicas)
        self.kv_cache_bytes = sum(r.kv_cache_bytes for r in self.replicas)
        self.compile_seconds = sum(r.compile_seconds for r in self.replicas)
        self.compile_cache = {
            "dir": first.compile_cache["dir"],
            "buckets_compiled": sum(r.compile_cache["buckets_compiled"] for r in self.replicas),
            "buckets_from_cache": sum(r.compile_cache["buckets_from_cache"] for r in self.replicas),
        }
        self.pool = _PoolTotals(self.replicas)
        self._owner: dict[str, int] = {}  # request id -> replica index, until it finishes
        self._ids = itertools.count()
        self._step_trace: list[dict[str, Any]] | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=len(self.replicas), thread_name_prefix="jaxcb-replica"
        )

    # ---- requests -----------------------------------------------------------------------

    def _least_loaded(self) -> int:
        def load(i: int) -> tuple[int, int, int]:
            replica = self.replicas[i]
            return (replica.scheduler.num_unfinished, replica.pool.num_used, i)

        return min(range(len(self.replicas)), key=load)

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
        """Queue a request on the least-loaded replica (LLMEngine.add_request's contract)."""
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self._owner:
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        index = self._least_loaded()
        self.replicas[index].add_request(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            final_only=final_only,
        )
        self._owner[request_id] = index
        return request_id

    def validate_request(
        self, prompt: str | Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        return self.replicas[0].validate_request(prompt, params, priority=priority)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        index = self._owner.get(str(request_id))
        if index is None:
            return None
        out = self.replicas[index].abort_request(request_id)
        if out is None or out.finished:
            self._owner.pop(str(request_id), None)
        return out

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their outputs together."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) == 1:
            results = [busy[0].step()]
        else:
            results = list(self._executor.map(LLMEngine.step, busy))
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        if self._step_trace is not None:
            for i, replica in enumerate(self.replicas):
                for entry in replica.step_trace or ():
                    self._step_trace.append({**entry, "replica": i})
                if replica.step_trace:
                    replica.step_trace.clear()
        return outputs

    @property
    def step_trace(self) -> list[dict[str, Any]] | None:
        """Per-step records of every replica (each tagged with "replica"); None: off."""
        return self._step_trace

    @step_trace.setter
    def step_trace(self, value: list[dict[str, Any]] | None) -> None:
        self._step_trace = value
        for replica in self.replicas:
            replica.step_trace = None if value is None else []

    # ---- introspection ------------------------------------------------------------------

    def check_page_invariant(self) -> None:
        for replica in self.replicas:
            replica.check_page_invariant()

    def check_health(self) -> None:
        for i, replica in enumerate(self.replicas):
            try:
                replica.check_health()
            except RuntimeError as exc:
                raise RuntimeError(f"data-parallel replica {i}: {exc}") from exc

    def reset_prefix_cache(self) -> int:
        return sum(r.reset_prefix_cache() for r in self.replicas)

    def stats(self) -> dict[str, Any]:
        """LLMEngine.stats() summed over the replicas, each replica's own under "replicas"."""
        per_replica = [r.stats() for r in self.replicas]
        total: dict[str, Any] = {}
        for key, value in per_replica[0].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = sum(s[key] for s in per_replica)
        hist: Counter[int] = Counter()
        slots = scheduled = 0.0
        for s in per_replica:
            hist.update(s["bucket_histogram"])
            replica_slots = sum(b * n for b, n in s["bucket_histogram"].items())
            slots += replica_slots
            scheduled += replica_slots * (1.0 - s["padding_fraction"])
        total["bucket_histogram"] = dict(sorted(hist.items()))
        total["padding_fraction"] = (slots - scheduled) / slots if slots else 0.0
        queries, hits = total.get("prefix_queries", 0), total.get("prefix_hits", 0)
        total["prefix_hit_rate"] = hits / queries if queries else 0.0
        total["compile_cache"] = dict(self.compile_cache)
        total["compile_seconds_per_bucket"] = per_replica[0]["compile_seconds_per_bucket"]
        total["data_parallel_size"] = len(self.replicas)
        total["replicas"] = per_replica
        return total

    def close(self) -> None:
        self._executor.shutdown(wait=True)
