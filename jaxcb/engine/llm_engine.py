"""LLMEngine: add_request / step / abort — the loop shared by `LLM.generate` and the server.

`step()` is: schedule (host) → pack into the smallest bucket → run the compiled step (device)
→ append sampled tokens, detokenize, check stops, free finished requests' pages (host: the
OutputProcessor, engine/output_processor.py, which also keeps the requests by id).
With `scheduler.async_scheduling` it runs a step ahead of the device: schedule, pack and
dispatch step N+1, then read back and apply step N's tokens, so the host's work overlaps the
device's (engine/inflight.py); a request's tokens come one `step()` later.

The engine is handed a ready runner (runtime/setup.py builds it: mesh, params, KV pool,
compiled buckets) and the model's tokenizer and EOS ids; it builds the host side itself (the
page pool, the scheduler) and never imports jax, the models or the kernels.

Fault isolation: an exception while handling one request's new token (detokenizer, stop
strings, output building) fails that request alone — finish_reason "error", the message in
`RequestOutput.error`, its pages freed — and every other request goes on (the
OutputProcessor sees to it). An exception from the step itself (scheduling, packing, the
device) propagates: the engine's state is suspect then, and the caller (LLM.generate, the
server's engine loop) decides what to do.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket, pick_bucket
from jaxcb.engine.detokenizer import IncrementalDetokenizer
from jaxcb.engine.engine_stats import engine_stats
from jaxcb.engine.grammar import GrammarCompiler
from jaxcb.engine.groups import RequestGroup, new_sample
from jaxcb.engine.inflight import InFlightStep, link_to_inflight, sync_reason
from jaxcb.engine.interface import (
    Engine,
    EngineInfo,
    KVUsage,
    Runner,
    SpecDecodeCounts,
    StepRecord,
)
from jaxcb.engine.lora_slots import LoRARequest, LoraSlots
from jaxcb.engine.output_processor import OutputProcessor
from jaxcb.engine.sched.factory import build_itl_controller, build_scheduler, build_swapper
from jaxcb.engine.sched.itl_controller import shared_token_budget
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.engine.spec import DraftModel, Speculator
from jaxcb.engine.step_observer import StepObserver, StepTimes
from jaxcb.engine.validation import check_params, check_prompt_length, encode_prompt
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine(Engine):
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: Runner,
        info: EngineInfo,
        tokenizer: Any | None,
        eos_token_ids: Sequence[int],
        draft: DraftModel | None = None,
    ) -> None:
        """`runner` and `info` from the factory (jaxcb/build.py, runtime/setup.py); `tokenizer`:
        a transformers tokenizer, or None (token-id prompts only); `draft`: the draft model
        of speculative decoding's "draft_model" method."""
        self.config = config
        self.info = info
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size, self.eos_token_ids)
        self.limits = config.limits
        self.pool = PagePool(info.num_pages)
        self.swapper = build_swapper(config, info)  # None: preemption by recompute only
        self.scheduler = build_scheduler(config, self.pool, self.swapper)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.itl = build_itl_controller(config, info)  # None: the fixed token budget
        # Speculative decoding (engine/spec/): None when off.
        self.speculator = Speculator.build(config.speculative_config, self.max_model_len, draft)
        self._draft = draft
        self.observer = StepObserver(
            self.pool,
            itl=self.itl,
            swap_cost=self.swapper.cost if self.swapper is not None else None,
        )
        self._stats = self.observer.counts  # (requests, tokens, failures counted here too)
        # The requests by id, and a step's tokens applied to them.
        self.output_processor = OutputProcessor(
            self.scheduler, self._stats, max_model_len=self.max_model_len
        )
        # Async scheduling (engine/inflight.py): the step dispatched and not yet read back.
        self._sync_reason = sync_reason(
            config, runner, swap=self.swapper is not None, itl=self.itl is not None
        )
        asked = config.scheduler.async_scheduling  # None: wherever it can overlap
        if asked and self._sync_reason:
            logger.warning("async_scheduling is off: %s", self._sync_reason)
        self._async = asked is not False and self._sync_reason is None
        self._inflight: InFlightStep | None = None
        # LoRA: the adapters added so far, by lora_int_id, with the root of their prefix
        # cache hashes; the device's slots are the scheduler's.
        self.loras: dict[int, tuple[LoRARequest, bytes]] = {}
        self._lora_keys = itertools.count(1)
        if info.max_loras:
            self.scheduler.lora_slots = LoraSlots(info.max_loras)

    # ---- requests -----------------------------------------------------------------------

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
        """Validate and queue a request; returns its id. Bad input raises ValueError and
        leaves the engine untouched. `priority` matters under the "priority" policy only
        (lower values are admitted first); elsewhere it must be 0. `final_only`: step()
        returns the request's output once, when it finishes, instead of after every token
        (vLLM's RequestOutputKind.FINAL_ONLY; what LLM.generate asks for). `lora_request`:
        the adapter to run it with (added on first use; None: the base model)."""
        params = params or SamplingParams()
        prompt_text, prompt_ids = self.validate_request(prompt, params, priority=priority)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora = self.add_lora(lora_request) if lora_request is not None else (0, b"")
        grammar = self.grammars.compile(params.structured_outputs)  # None: unconstrained
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = [
            new_sample(
                request_id,
                prompt_ids,
                params,
                j,
                arrival=arrival,
                priority=priority,
                rng=self._rng,
                max_model_len=self.max_model_len,
                config=self.config,
                eos_token_ids=self.eos_token_ids,
                lora=lora,
            )
            for j in range(params.n)
        ]
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            for _ in children
        ]
        group = RequestGroup(request_id, prompt_text, prompt_ids, children, detoks, final_only)
        self.output_processor.add(group)
        for child in children:
            child.grammar = grammar and self.grammars.matcher(grammar)
            self.scheduler.add(child)
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += len(prompt_ids) * params.n
        return request_id

    def read_lora(self, lora: LoRARequest) -> Any:
        self._check_lora_on(lora)
        return self.runner.read_lora(lora.lora_path)

    def _check_lora_on(self, lora: LoRARequest) -> None:
        if self.scheduler.lora_slots is None:
            raise ValueError(
                f"this engine serves no LoRA adapters (asked for {lora.lora_name!r}): start it "
                "with enable_lora=True"
            )

    def add_lora(self, lora: LoRARequest, values: Any = None) -> tuple[int, bytes]:
        """Make an adapter known (its weights read onto the host, unless `values` from
        `read_lora` are given), if it is not yet; returns (lora_int_id, its prefix-cache
        root). ValueError (one line) for an adapter that does not fit the base model, an id
        or name already another adapter's, or LoRA off."""
        self._check_lora_on(lora)
        known = self.loras.get(lora.lora_int_id)
        if known is not None:
            if known[0] != lora:
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is already adapter "
                    f"{known[0].lora_name!r} ({known[0].lora_path})"
                )
            return lora.lora_int_id, known[1]
        for other, _ in self.loras.values():
            if other.lora_name == lora.lora_name:
                raise ValueError(
                    f"LoRA name {lora.lora_name!r} is already adapter {other.lora_int_id} "
                    f"({other.lora_path})"
                )
        self.runner.add_lora(lora.lora_int_id, lora.lora_path, values)
        key = f"lora:{next(self._lora_keys)}".encode()
        self.loras[lora.lora_int_id] = (lora, key)
        return lora.lora_int_id, key

    def list_loras(self) -> list[LoRARequest]:
        return [lora for lora, _ in self.loras.values()]

    def lora_counts(self) -> tuple[int, int]:
        return len(self.loras), self._stats["lora_loads"]

    def remove_lora(self, lora_int_id: int) -> LoRARequest:
        """Forget an adapter (its slot and its host copy); ValueError if it is unknown or
        a queued or running request uses it."""
        if lora_int_id not in self.loras:
            raise ValueError(f"no LoRA adapter has lora_int_id {lora_int_id}")
        lora = self.loras[lora_int_id][0]
        users = sum(
            r.lora_id == lora_int_id for r in [*self.scheduler.waiting, *self.scheduler.running]
        )
        if users:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is in use by {users} requests")
        self.scheduler.lora_slots.forget(lora_int_id)
        self.runner.remove_lora(lora_int_id)
        del self.loras[lora_int_id]
        return lora

    def validate_request(
        self, prompt: str | Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        """Check a prompt and its parameters against the model and the limits; returns
        (prompt text or None, prompt token ids). Raises ValueError naming the problem."""
        check_params(params, priority, self.config)
        prompt_text, prompt_ids = encode_prompt(prompt, self.tokenizer, self.info.vocab_size)
        check_prompt_length(len(prompt_ids), self.max_model_len, self.limits)
        return prompt_text, prompt_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages. Unknown or finished ids are ignored."""
        group = self.output_processor.groups.get(str(request_id))
        if group is None:
            return None
        now = time.monotonic()
        for child in group.children:
            if not child.finished:
                child.finish_reason = "abort"
                child.metrics.finished_time = now
                self.scheduler.finish(child)
        self._stats["aborted"] += 1
        if self._inflight is not None and self._inflight.all_finished:
            self._retire()  # its tokens are all dropped: leave nothing in flight
        return self.output_processor.output(group, now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step -----------------------------------------------------------------------

    @property
    def async_scheduling(self) -> bool:
        """Whether steps overlap (engine/inflight.py); settable between steps (the compiled
        steps serve both ways), not while a step is in flight."""
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if on and self._sync_reason:
            raise ValueError(f"async_scheduling is not available: {self._sync_reason}")
        if self._inflight is not None:
            raise RuntimeError("a step is in flight: switch async_scheduling between runs")
        self._async = bool(on)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that got tokens or finished."""
        if self._async:
            return self._step_async()
        t0 = time.perf_counter()
        if self.speculator is not None:
            self._propose(self.speculator.wants_proposals(self.scheduler.running))
        sched, budget = self._schedule()
        if sched.is_empty:
            self._swap(sched)  # (a step that only preempts: its victims' pages still go out)
            return []
        bucket = self._bucket(sched)
        prepared = self.runner.prepare(sched, bucket)
        # (before the results: a chunk's `samples` compares with the request's tokens)
        samples = [c.samples for c in sched.chunks]
        had_decode = sched.num_decode_tokens > 0
        t1 = time.perf_counter()
        swap_seconds = self._swap(sched)
        self._load_loras(sched)
        result = self.runner.execute(bucket, prepared)
        t2 = time.perf_counter()
        self.scheduler.update_after_step(sched)
        outputs = self.output_processor.process(sched, result, samples)
        if self.speculator is not None:
            self.speculator.observe(sched, t2 - t1 - swap_seconds, self.scheduler.running)
        t3 = time.perf_counter()
        times = StepTimes(t0, t3, host=(t1 - t0) + (t3 - t2), device=t2 - t1, swap=swap_seconds)
        self.observer.ran(
            sched,
            bucket.num_tokens,
            budget,
            times,
            had_decode=had_decode,
            still_running=bool(self.scheduler.running),
        )
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """One iteration a step ahead of the device: schedule, pack and dispatch step N+1,
        then read back step N's tokens and apply them (engine/inflight.py). Returns step
        N's outputs. Host seconds: the work done here; device seconds: the waits for
        results (which the host's work hides behind while the device is the slower)."""
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        waited = 0.0
        pending = self._inflight
        speculate = self.speculator is not None and self.speculator.wants_proposals(
            self.scheduler.running
        )
        if pending is not None and (pending.needs_host_tokens or speculate):
            # (penalties read its tokens on the host; proposals follow them)
            outputs, waited = self._retire()
            pending = None
            self._stats["async_drains"] += 1
        if self.speculator is not None:
            self._propose(speculate)
        sched, budget = self._schedule()
        if sched.is_empty:
            if pending is not None:
                more, seconds = self._retire()
                outputs, waited = outputs + more, waited + seconds
            self.observer.idle(host=time.perf_counter() - t0 - waited, device=waited)
            return outputs
        bucket = self._bucket(sched)
        link_to_inflight(sched, pending)
        prepared = self.runner.prepare(sched, bucket)
        self._load_loras(sched)
        self._inflight = InFlightStep.dispatch(
            self.runner, sched, bucket, prepared, alone=pending is None
        )
        if pending is not None:
            more, seconds = self._retire(pending)
            outputs, waited = outputs + more, waited + seconds
        # (after step N's tokens: the pages this step fills are hashed with them)
        self.scheduler.update_after_step(sched)
        if self._inflight.all_finished:
            waited += self._retire()[1]  # nothing of it is wanted: leave nothing in flight
        t1 = time.perf_counter()
        times = StepTimes(t0, t1, host=t1 - t0 - waited, device=waited)
        self.observer.ran(sched, bucket.num_tokens, budget, times)
        return outputs

    def _retire(self, step: InFlightStep | None = None) -> tuple[list[RequestOutput], float]:
        """Read back a dispatched step (default: the one in flight) and apply its tokens;
        (its outputs, seconds waited for them)."""
        step = step or self._inflight
        if step is self._inflight:
            self._inflight = None
        t0 = time.perf_counter()
        result = step.collect(self.runner)
        t1 = time.perf_counter()
        outputs = self.output_processor.process(step.sched, result, step.samples)
        if self.speculator is not None:  # (its seconds are the device's if nothing overlapped)
            alone = step.alone and self._inflight is None
            seconds = t1 - step.dispatched_at if alone else None
            self.speculator.observe(step.sched, seconds, self.scheduler.running)
        return outputs, t1 - t0

    def _propose(self, on: bool) -> None:
        """Speculative decoding: this step's proposals (their tokens are all on the host),
        or none."""
        if on:
            self.speculator.propose(self.scheduler.running)
        else:
            self.speculator.clear(self.scheduler.running)

    def _swap(self, sched: SchedulerOutput) -> float:
        """The step's swap copies (out, then in) before it runs; returns their seconds."""
        if not (sched.swap_out or sched.swap_in):
            return 0.0
        t0 = time.perf_counter()
        self.runner.swap(sched.swap_out, sched.swap_in)
        seconds = time.perf_counter() - t0
        self._stats["swap_seconds"] += seconds
        return seconds

    def _load_loras(self, sched: SchedulerOutput) -> None:
        """The adapters the step's admitted requests need written into their slots."""
        for slot, lora_id in sched.lora_loads:
            self.runner.load_lora_slot(slot, lora_id)
        self._stats["lora_loads"] += len(sched.lora_loads)

    def _schedule(self) -> tuple[SchedulerOutput, int]:
        """This step's schedule and the token budget it was made under: the ITL
        controller's for the running decodes, or else max_num_batched_tokens shared by them
        (`min_token_budget`), else max_num_batched_tokens."""
        floor = self.config.scheduler.min_token_budget
        if self.itl is None and not floor:
            return self.scheduler.schedule(), self.scheduler.max_num_batched_tokens
        num_decodes = sum(r.is_decoding for r in self.scheduler.running)
        if self.itl is not None:
            budget = self.itl.step_budget(num_decodes)
        else:
            budget = shared_token_budget(
                self.info.token_buckets, self.scheduler.max_num_batched_tokens, floor, num_decodes
            )
        return self.scheduler.schedule(token_budget=budget), budget

    def _bucket(self, sched: SchedulerOutput) -> Bucket:
        """The smallest bucket the step fits; a padded-batch baseline's padding is run too
        (engine/sched/baselines.py; 0 otherwise)."""
        tokens = sched.num_tokens + sched.num_padding_tokens
        return pick_bucket(self.info.buckets, tokens, sched.num_sample_rows)

    # ---- introspection ------------------------------------------------------------------

    def record_steps(self, on: bool = True) -> None:
        self.observer.records = [] if on else None

    def pop_step_records(self) -> list[StepRecord]:
        records = self.observer.records or []
        if self.observer.records is not None:
            self.observer.records = []
        return records

    def kv_usage(self) -> KVUsage:
        pool = self.pool
        return KVUsage(
            num_pages=pool.num_pages,
            num_used=pool.num_used,
            num_cached=pool.num_cached,
            peak_used=pool.peak_used,
            num_evictions=pool.num_evictions,
            num_swap_pages=self.swapper.space.num_slots if self.swapper else 0,
            num_swap_used=self.swapper.space.num_used if self.swapper else 0,
        )

    def spec_decode_counts(self) -> SpecDecodeCounts:
        s = self._stats  # (OutputProcessor.append_verified counts them)
        return SpecDecodeCounts(s["spec_drafts"], s["spec_draft_tokens"], s["spec_accepted_tokens"])

    def check_page_invariant(self) -> None:
        self.pool.check_invariant(self.scheduler.owners())
        if self.swapper is not None:
            self.swapper.space.check_invariant(
                r.swap_slots for r in self.scheduler.waiting if r.swap_slots is not None
            )

    def check_health(self) -> None:
        """Raise RuntimeError if the engine cannot run further steps: a failed step consumed
        its donated KV buffers, or the page accounting is broken."""
        self.runner.check_health()
        try:
            self.check_page_invariant()
        except RuntimeError as exc:
            raise RuntimeError(f"the KV page accounting is broken: {exc}") from exc

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no request holds; returns how many were dropped."""
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        return engine_stats(self, self._stats, self.observer.bucket_hist)

    def close(self) -> None:
        self.runner.close()
        if self._draft is not None:
            self._draft.runner.close()
