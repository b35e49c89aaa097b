"""Data parallelism: independent engine replicas behind the one Engine interface.

`jaxcb.build.build_engine(config)` builds one `LLMEngine` when `data_parallel_size` is 1,
else a `ReplicatedEngine` of that many, each on its own row of the (data, tensor) device mesh,
with its own KV pool, scheduler and compiled buckets. Nothing is shared between replicas but
the request stream:

- `add_request` sends a request to the least-loaded replica: fewest unfinished sequences
  (waiting + running), then fewest KV pages in use, then the lowest index;
- `step` steps every replica that has work, concurrently (one thread each: the device work
  of one overlaps the others', and jax releases the GIL while it waits), and returns their
  outputs together;
- request ids are unique across replicas; `abort_request` finds the owner.

Across hosts, run one job per host (or slice) instead: each process drives its own devices.
Host side: this module only routes; it imports no jax.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxcb.config import EngineConfig
from jaxcb.engine.interface import Engine, EngineInfo, KVUsage, SpecDecodeCounts, StepRecord
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def combined_info(infos: Sequence[EngineInfo]) -> EngineInfo:
    """The replicas' facts as one engine's: the model and buckets of the first, the KV pool,
    load and compile figures summed."""
    first = infos[0]
    cache = first.compile_cache
    return dataclasses.replace(
        first,
        num_pages=sum(i.num_pages for i in infos),
        kv_cache_bytes=sum(i.kv_cache_bytes for i in infos),
        num_swap_pages=sum(i.num_swap_pages for i in infos),
        load_seconds=sum(i.load_seconds for i in infos),
        compile_seconds=sum(i.compile_seconds for i in infos),
        compile_cache={
            "dir": cache.get("dir"),
            "buckets_compiled": sum(i.compile_cache["buckets_compiled"] for i in infos),
            "buckets_from_cache": sum(i.compile_cache["buckets_from_cache"] for i in infos),
            "buckets_in_background": sum(
                i.compile_cache.get("buckets_in_background", 0) for i in infos
            ),
        },
    )


class ReplicatedEngine(Engine):
    """`data_parallel_size` LLMEngines; see the module docstring."""

    def __init__(self, config: EngineConfig, replicas: Sequence[LLMEngine]) -> None:
        if not replicas:
            raise ValueError("a replicated engine needs at least one replica")
        self.config = config
        self.replicas = list(replicas)
        self.info = combined_info([r.info for r in self.replicas])
        self.tokenizer = self.replicas[0].tokenizer
        self._owner: dict[str, int] = {}  # request id -> replica index, until it finishes
        self._ids = itertools.count()
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
        lora_request: LoRARequest | None = None,
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
            lora_request=lora_request,
        )
        self._owner[request_id] = index
        return request_id

    def read_lora(self, lora: LoRARequest) -> Any:
        return self.replicas[0].read_lora(lora)  # (the replicas run the same model)

    def add_lora(self, lora: LoRARequest, values: Any = None) -> Any:
        if values is None:
            values = self.read_lora(lora)  # (read once for every replica)
        results = [replica.add_lora(lora, values) for replica in self.replicas]
        return results[0]

    def remove_lora(self, lora_int_id: int) -> LoRARequest:
        results = [replica.remove_lora(lora_int_id) for replica in self.replicas]
        return results[0]

    def list_loras(self) -> list[LoRARequest]:
        return self.replicas[0].list_loras()

    def lora_counts(self) -> tuple[int, int]:
        loads = sum(replica.lora_counts()[1] for replica in self.replicas)
        return self.replicas[0].lora_counts()[0], loads

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
        return outputs

    # ---- introspection ------------------------------------------------------------------

    def record_steps(self, on: bool = True) -> None:
        for replica in self.replicas:
            replica.record_steps(on)

    def pop_step_records(self) -> list[StepRecord]:
        """Every replica's records, each tagged with its replica index."""
        return [
            dataclasses.replace(record, replica=i)
            for i, replica in enumerate(self.replicas)
            for record in replica.pop_step_records()
        ]

    def kv_usage(self) -> KVUsage:
        usages = [r.kv_usage() for r in self.replicas]
        return KVUsage(
            *(sum(getattr(u, f.name) for u in usages) for f in dataclasses.fields(KVUsage))
        )

    def spec_decode_counts(self) -> SpecDecodeCounts:
        counts = [r.spec_decode_counts() for r in self.replicas]
        return SpecDecodeCounts(
            *(sum(getattr(c, f.name) for c in counts) for f in dataclasses.fields(SpecDecodeCounts))
        )

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
        total["compile_cache"] = dict(self.info.compile_cache)
        total["compile_seconds_per_bucket"] = per_replica[0]["compile_seconds_per_bucket"]
        total["data_parallel_size"] = len(self.replicas)
        # the same on every replica (a size, not a count)
        total["kv_cache_dtype"] = per_replica[0]["kv_cache_dtype"]
        total["kv_bytes_per_token"] = per_replica[0]["kv_bytes_per_token"]
        # each replica predicts from its own finished requests: report the largest
        predictions = [s["predicted_output_len"] for s in per_replica]
        total["predicted_output_len"] = max((p for p in predictions if p is not None), default=None)
        # each replica steers its own budget (a level, not a count): report the smallest
        total["prefill_budget"] = min(s["prefill_budget"] for s in per_replica)
        total["replicas"] = per_replica
        return total

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for replica in self.replicas:
            replica.close()
