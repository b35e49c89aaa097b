"""LLMEngine: add_request / step / abort — the loop shared by `LLM.generate` and the server.

`step()` is: schedule (host) → pack into the smallest bucket → run the compiled step (device)
→ append sampled tokens, detokenize, check stops, free finished requests' pages (host).

The engine is handed a ready runner (runtime/setup.py builds it: mesh, params, KV pool,
compiled buckets) and the model's tokenizer and EOS ids; it builds the host side itself (the
page pool, the scheduler) and never imports jax, the models or the kernels.

Fault isolation: an exception while handling one request's new token (detokenizer, stop
strings, output building) fails that request alone — finish_reason "error", the message in
`RequestOutput.error`, its pages freed — and every other request goes on. An exception from
the step itself (scheduling, packing, the device) propagates: the engine's state is suspect
then, and the caller (LLM.generate, the server's engine loop) decides what to do.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import pick_bucket
from jaxcb.engine.builders import build_itl_controller, build_scheduler, build_swapper
from jaxcb.engine.detokenizer import IncrementalDetokenizer
from jaxcb.engine.groups import RequestGroup
from jaxcb.engine.interface import (
    Engine,
    EngineInfo,
    KVUsage,
    Runner,
    StepRecord,
    StepResult,
)
from jaxcb.engine.logprobs import append_sample_logprobs, record_prompt_logprobs
from jaxcb.engine.page_pool import PagePool
from jaxcb.engine.request import Request
from jaxcb.engine.schedule import SchedulerOutput
from jaxcb.engine.validation import check_params, check_prompt_length, encode_prompt
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples


class LLMEngine(Engine):
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: Runner,
        info: EngineInfo,
        tokenizer: Any | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        """`runner` and `info` from the composition root (runtime/setup.py); `tokenizer`:
        a transformers tokenizer, or None (token-id prompts only)."""
        self.config = config
        self.info = info
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = config.limits
        self.pool = PagePool(info.num_pages)
        self.swapper = build_swapper(config, info)  # None: preemption by recompute only
        self.scheduler = build_scheduler(config, self.pool, self.swapper)
        self._rng = np.random.default_rng(config.seed)
        self._groups: dict[str, RequestGroup] = {}
        self._request_group: dict[int, RequestGroup] = {}  # id(child) -> group
        self._ids = itertools.count()
        self._stats = Counter()
        self._bucket_hist: Counter[int] = Counter()
        self._records: list[StepRecord] | None = None  # record_steps() turns it on
        self.itl = build_itl_controller(config, info)  # None: the fixed token budget
        self._last_step_end: float | None = None  # perf_counter() after the last step, if any ran

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
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError and
        leaves the engine untouched. `priority` matters under the "priority" policy only
        (lower values are admitted first); elsewhere it must be 0. `final_only`: step()
        returns the request's output once, when it finishes, instead of after every token
        (vLLM's RequestOutputKind.FINAL_ONLY; what LLM.generate asks for)."""
        params = params or SamplingParams()
        prompt_text, prompt_ids = self.validate_request(prompt, params, priority=priority)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = [
            self._new_child(request_id, prompt_ids, params, j, arrival, priority)
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
        self._groups[request_id] = group
        for child in children:
            self._request_group[id(child)] = group
            self.scheduler.add(child)
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += len(prompt_ids) * params.n
        return request_id

    def _new_child(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        j: int,
        arrival: float,
        priority: int,
    ) -> Request:
        """Sample j of n: its own id, seed and output budget; latency targets its own, or
        the config's defaults."""
        room = max(1, self.max_model_len - len(prompt_ids))
        cap = self.limits.max_output_tokens or room
        if params.seed is not None:
            seed = (params.seed + j * SEED_STRIDE) % (1 << 64)
        else:
            seed = int(self._rng.integers(0, 1 << 63))
        return Request(
            request_id=request_id if params.n == 1 else f"{request_id}-{j}",
            prompt_token_ids=prompt_ids,
            params=params,
            seed=seed,
            max_tokens=min(params.max_tokens or cap, cap, room),
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival,
            priority=priority,
            ttft_target_ms=_or(params.ttft_target_ms, self.config.scheduler.ttft_target_ms),
            tpot_target_ms=_or(params.tpot_target_ms, self.config.scheduler.tpot_target_ms),
            # the first sample computes the prompt logprobs for all n
            prompt_logprobs=[None] if params.prompt_logprobs is not None and j == 0 else None,
        )

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
        group = self._groups.get(str(request_id))
        if group is None:
            return None
        now = time.monotonic()
        for child in group.children:
            if not child.finished:
                child.finish_reason = "abort"
                child.metrics.finished_time = now
                self.scheduler.finish(child)
        self._stats["aborted"] += 1
        return self._output(group, now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that got tokens or finished."""
        t0 = time.perf_counter()
        sched, budget = self._schedule()
        if sched.is_empty:
            self._swap(sched)  # (a step that only preempts: its victims' pages still go out)
            return []
        # (before the results: a chunk's `samples` compares with the request's tokens)
        had_decode = self.itl is not None and sched.num_decode_tokens > 0
        # A padded-batch baseline's padding is run too (engine/baselines.py); 0 otherwise.
        bucket = pick_bucket(
            self.info.buckets, sched.num_tokens + sched.num_padding_tokens, len(sched.chunks)
        )
        prepared = self.runner.prepare(sched, bucket)
        t1 = time.perf_counter()
        swap_seconds = self._swap(sched)
        result = self.runner.execute(bucket, prepared)
        t2 = time.perf_counter()
        if self.swapper is not None and self.swapper.cost is not None:
            self.swapper.cost.observe_step(sched.num_tokens, t2 - t1 - swap_seconds)
        self.scheduler.update_after_step(sched)
        outputs = self._process_results(sched, result)
        t3 = time.perf_counter()
        self._count_step(
            sched, bucket.num_tokens, budget, host=(t1 - t0) + (t3 - t2), device=t2 - t1
        )
        if self.itl is not None:
            # The ITL a decoding request sees: from the previous step's end (the caller's
            # work between steps included) to this one's; nothing ran before: this step.
            start = t0 if self._last_step_end is None else self._last_step_end
            self.itl.feed(t3 - start, had_decode, bucket.num_tokens)
            self._last_step_end = t3 if self.scheduler.running else None
        return outputs

    def _swap(self, sched: SchedulerOutput) -> float:
        """The step's swap copies (out, then in) before it runs; returns their seconds."""
        if not (sched.swap_out or sched.swap_in):
            return 0.0
        t0 = time.perf_counter()
        self.runner.swap(sched.swap_out, sched.swap_in)
        seconds = time.perf_counter() - t0
        self._stats["swap_seconds"] += seconds
        return seconds

    def _schedule(self) -> tuple[SchedulerOutput, int]:
        """This step's schedule and the token budget it was made under: the ITL
        controller's for the running decodes, else max_num_batched_tokens."""
        if self.itl is None:
            return self.scheduler.schedule(), self.scheduler.max_num_batched_tokens
        num_decodes = sum(r.is_decoding for r in self.scheduler.running)
        budget = self.itl.step_budget(num_decodes)
        return self.scheduler.schedule(token_budget=budget), budget

    def _count_step(
        self,
        sched: SchedulerOutput,
        bucket_tokens: int,
        token_budget: int,
        *,
        host: float,
        device: float,
    ) -> None:
        s = self._stats
        s["steps"] += 1
        s["tokens_scheduled"] += sched.num_tokens
        s["token_slots"] += bucket_tokens
        s["preemptions"] += len(sched.preempted)
        s["recomputed_tokens"] += sched.num_recomputed_tokens
        s["prefix_queries"] += sched.num_prefix_query_tokens
        s["prefix_hits"] += sched.num_prefix_hit_tokens
        s["host_seconds"] += host
        s["device_seconds"] += device
        self._bucket_hist[bucket_tokens] += 1
        if self._records is not None:
            self._records.append(
                StepRecord.of(sched, bucket_tokens, self.pool.num_used, token_budget)
            )

    def _process_results(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        record_prompt_logprobs(sched.chunks, result)
        for s, chunk in enumerate(sched.chunks):
            req = chunk.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if not chunk.samples or req.finished:
                continue
            group = self._request_group[id(req)]
            touched[group.request_id] = group
            try:
                self._append_sample(req, group, result, s, now)
            except Exception as exc:  # this request's problem only: the others go on
                self._fail_request(req, exc, now)
        return [self._output(g, now) for g in touched.values() if g.finished or not g.final_only]

    def _append_sample(
        self, req: Request, group: RequestGroup, result: StepResult, s: int, now: float
    ) -> None:
        """The token sampled for row s: append it, detokenize, check every stop condition."""
        token = int(result.token_ids[s])
        req.append_token(token)
        append_sample_logprobs(req, result, s)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        self._stats["generated_tokens"] += 1
        detok = group.detokenizer(req)
        stop_str = detok.add_token(token)
        if stop_str is None:
            req.check_stop_tokens(self.max_model_len)
            if req.finish_reason is not None:
                stop_str = detok.flush()  # may complete a stop string too
        if stop_str is not None:  # a stop string beats EOS and length limits
            req.finish_reason, req.stop_reason = "stop", stop_str
        if req.finish_reason is not None:
            req.metrics.finished_time = now
            self.scheduler.finish(req)

    def _fail_request(self, req: Request, exc: BaseException, now: float) -> None:
        """End one request with finish_reason "error" and free its pages."""
        logger.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
        req.finish_reason, req.stop_reason = "error", None
        req.error = f"{type(exc).__name__}: {exc}"
        req.metrics.finished_time = now
        self.scheduler.finish(req)
        self._stats["failed"] += 1

    def _output(self, group: RequestGroup, now: float) -> RequestOutput:
        """The group's output; a finished group is forgotten. If building it fails, the
        group's unfinished requests fail (and its texts are dropped) rather than the loop."""
        try:
            out = group.output()
        except Exception as exc:
            for child in group.children:
                if not child.finished:
                    self._fail_request(child, exc, now)
                elif child.error is None:
                    child.error = f"{type(exc).__name__}: {exc}"
            group.broken = True
            out = group.output()
        if group.finished:
            self._groups.pop(group.request_id, None)
            for child in group.children:
                self._request_group.pop(id(child), None)
        return out

    # ---- introspection ------------------------------------------------------------------

    def record_steps(self, on: bool = True) -> None:
        self._records = [] if on else None

    def pop_step_records(self) -> list[StepRecord]:
        records = self._records or []
        if self._records is not None:
            self._records = []
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
        s, info, kv = self._stats, self.info, self.kv_usage()
        slots, queries = s["token_slots"], s["prefix_queries"]
        return {
            "steps": s["steps"],
            "requests": s["requests"],
            "aborted": s["aborted"],
            "prompt_tokens": s["prompt_tokens"],
            "generated_tokens": s["generated_tokens"],
            "bucket_histogram": dict(sorted(self._bucket_hist.items())),
            "padding_fraction": (slots - s["tokens_scheduled"]) / slots if slots else 0.0,
            "compile_seconds": info.compile_seconds,
            "compile_cache": dict(info.compile_cache),
            "compile_seconds_per_bucket": dict(info.compile_seconds_per_bucket),
            "kernels": {
                "attention": info.attention_backend,
                "matmul": info.matmul_backend,
                **info.cpu_kernels,
            },
            "preemptions": s["preemptions"],
            # computed tokens the preempted requests dropped (prefix cache hits not subtracted)
            "recomputed_tokens": s["recomputed_tokens"],
            "admitted_idle_pages": self.scheduler.admitted_idle_pages,
            "predicted_output_len": self.scheduler.predicted_output_len,
            "failed": s["failed"],
            # preemption by swap (engine/swap.py): victims whose pages went to host memory,
            # of them resumed, host pages held now, victims recomputed for want of host pages
            "swapped_out_requests": self.swapper.num_swapped_out if self.swapper else 0,
            "swapped_in_requests": self.swapper.num_swapped_in if self.swapper else 0,
            "swap_pages_used": kv.num_swap_used,
            "swap_pages_total": kv.num_swap_pages,
            "swap_fallbacks": self.swapper.num_fallbacks if self.swapper else 0,
            "swap_seconds": s["swap_seconds"],
            "prefix_queries": queries,
            "prefix_hits": s["prefix_hits"],
            "prefix_hit_rate": s["prefix_hits"] / queries if queries else 0.0,
            "kv_pages_total": kv.num_pages,
            "kv_pool_sizing": info.kv_pool_sizing,
            "kv_pages_used": kv.num_used,
            "kv_pages_peak": kv.peak_used,
            "kv_pages_cached": kv.num_cached,
            "kv_pages_evicted": kv.num_evictions,
            "host_seconds": s["host_seconds"],
            "device_seconds": s["device_seconds"],
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            # the ITL controller's token budget per step; max_num_batched_tokens without one
            "prefill_budget": (
                self.itl.budget if self.itl else self.config.scheduler.max_num_batched_tokens
            ),
        }


def _or(value: float | None, default: float | None) -> float | None:
    return default if value is None else value
