"""LLMEngine: add_request / step / abort — the loop shared by `LLM.generate` and the server.

`step()` is: schedule (host) → pack into the smallest bucket → run the compiled step (device)
→ append sampled tokens, detokenize, check stops, free finished requests' pages (host).

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxcb.config import EngineConfig
from jaxcb.engine.baselines import make_scheduler
from jaxcb.engine.buckets import default_token_buckets, make_buckets, pick_bucket
from jaxcb.engine.detokenizer import IncrementalDetokenizer
from jaxcb.engine.page_pool import PagePool
from jaxcb.engine.policies import make_policy
from jaxcb.engine.request import Request
from jaxcb.engine.scheduler import SchedulerOutput
from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxcb.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # as in the OpenAI API
SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples


@dataclass
class _Group:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    final_only: bool = False  # step() reports it once, when finished (offline generate)
    broken: bool = False  # building its output failed: texts are no longer available

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        compile_progress: bool = False,
        devices: Sequence[Any] | None = None,  # this replica's devices (engine/replicated.py)
    ):
        import functools

        import jax
        import jax.numpy as jnp

        from jaxcb.attention import get_attention_backend
        from jaxcb.models.loader import load_model
        from jaxcb.runtime import sharding
        from jaxcb.runtime.kv_cache import page_bytes, resolve_kv_cache_dtype, resolve_num_pages
        from jaxcb.runtime.runner import ModelRunner
        from pallas_kernels.ragged_paged_attention import pages_per_seq

        self.config = config = config or EngineConfig()
        t0 = time.perf_counter()
        dtype = jnp.dtype(config.dtype)
        # One device, or tensor_parallel_size devices the model and KV pages are sharded over.
        self.mesh = mesh = sharding.engine_mesh(config.parallel, devices)
        model = load_model(
            config.model,
            tokenizer_path=config.tokenizer,
            dtype=dtype,
            shardings=functools.partial(sharding.model_param_shardings, mesh=mesh, dtype=dtype),
        )
        self.model_path, self.spec, self.tokenizer = model.path, model.spec, model.tokenizer
        self.eos_token_ids = frozenset(model.eos_token_ids)
        load_seconds = time.perf_counter() - t0
        self.load_seconds, self.model_format = load_seconds, model.format

        spec = self.spec
        max_model_len = config.max_model_len or spec.max_position_embeddings
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={spec.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        cache, sched = config.cache, config.scheduler
        self.page_size = cache.page_size
        self.pages_per_seq = pages_per_seq(max_model_len, cache.page_size)
        attention = get_attention_backend(config.kernels.attention)
        self.attention_backend = attention.name
        from jaxcb.runtime.runner import matmul_backend

        self.matmul_backend = matmul_backend(
            config.kernels.matmul,
            dtype=dtype,
            tensor_parallel_size=sharding.tensor_parallel_size(mesh),
        )
        kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype, attention.name)
        self.kv_cache_dtype = str(kv_dtype)
        num_pages = resolve_num_pages(
            cache,
            spec,
            itemsize=kv_dtype.itemsize,
            max_model_len=max_model_len,
            max_num_seqs=sched.max_num_seqs,
            params_bytes=sum(
                x.nbytes
                for x in jax.tree_util.tree_leaves(model.params)
                if not isinstance(x, jax.Array)  # orbax restores onto the devices directly
            ),
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            device=mesh.devices.flat[0],
        )
        self.num_pages = num_pages
        self.kv_cache_bytes = num_pages * page_bytes(spec, cache.page_size, kv_dtype.itemsize)
        token_buckets = sched.token_buckets or default_token_buckets(sched.max_num_batched_tokens)
        self.buckets = make_buckets(token_buckets, sched.max_num_seqs, sched.seq_buckets)

        self.pool = PagePool(num_pages)
        watermark_pages = sched.watermark_pages(num_pages)
        if watermark_pages >= num_pages:
            raise ValueError(
                f"watermark={sched.watermark} keeps {watermark_pages} pages free, but the pool "
                f"has only {num_pages}"
            )
        self.scheduler = make_scheduler(  # batching: continuous, or a padded-batch baseline
            sched.batching,
            page_pool=self.pool,
            page_size=cache.page_size,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            policy=make_policy(sched.scheduling_policy, srpf_aging=sched.srpf_aging),
            enable_prefix_caching=cache.enable_prefix_caching,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            watermark_pages=watermark_pages,
        )
        self.limits = config.limits
        self.runner = ModelRunner(
            spec,
            model.params,
            kv_cache_dtype=kv_dtype,
            num_pages=num_pages,
            page_size=cache.page_size,
            pages_per_seq=self.pages_per_seq,
            max_model_len=max_model_len,
            attention=attention,
            num_top_logprobs=MAX_TOP_LOGPROBS,
            mesh=mesh,
            pack_matmuls=None if self.matmul_backend == "xla" else self.matmul_backend,
            greedy_screen=config.kernels.greedy_screen,
        )
        from jaxcb.runtime import compile_cache

        cache_path = compile_cache.configure(config.compilation_cache)
        entries_before = compile_cache.count_step_entries(cache_path)
        self.compile_seconds = self.runner.compile(self.buckets, progress=compile_progress)
        fresh = compile_cache.count_step_entries(cache_path) - entries_before
        self.compile_cache = {
            "dir": str(cache_path) if cache_path else None,
            "buckets_compiled": fresh if cache_path else len(self.buckets),
            "buckets_from_cache": len(self.buckets) - fresh if cache_path else 0,
        }
        logger.info(
            "engine ready: %s (%s%s), dtype %s, %d %s KV pages x %d tokens (%.1f MiB), "
            "buckets %s, attention %s, matmul %s, on %s, load %.1fs, compile %.1fs (%d of %d "
            "buckets from the compilation cache)",
            model.path,
            spec.architecture,
            ", RANDOM WEIGHTS" if model.is_default else "",
            config.dtype,
            num_pages,
            self.kv_cache_dtype,
            cache.page_size,
            self.kv_cache_bytes / 2**20,
            sorted({b.num_tokens for b in self.buckets}),
            self.attention_backend,
            self.matmul_backend,
            jax.default_backend(),
            load_seconds,
            self.compile_seconds,
            self.compile_cache["buckets_from_cache"],
            len(self.buckets),
        )

        self._rng = np.random.default_rng(config.seed)
        self._groups: dict[str, _Group] = {}
        self._request_group: dict[int, _Group] = {}  # id(child) -> group
        self._ids = itertools.count()
        self._stats = Counter()
        self._bucket_hist: Counter[int] = Counter()
        self.step_trace: list[dict[str, Any]] | None = None  # set to [] to record steps

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
        room = max(1, self.max_model_len - len(prompt_ids))
        cap = self.limits.max_output_tokens or room
        max_tokens = min(params.max_tokens or cap, cap, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children, detoks = [], []
        for j in range(params.n):
            if params.seed is not None:
                seed = (params.seed + j * SEED_STRIDE) % (1 << 64)
            else:
                seed = int(self._rng.integers(0, 1 << 63))
            children.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{request_id}-{j}",
                    prompt_token_ids=prompt_ids,
                    params=params,
                    seed=seed,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                )
            )
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            )
        group = _Group(request_id, prompt_text, prompt_ids, children, detoks, final_only)
        self._groups[request_id] = group
        for child in children:
            self._request_group[id(child)] = group
            self.scheduler.add(child)
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += len(prompt_ids) * params.n
        return request_id

    def validate_request(
        self, prompt: str | Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        """Check a prompt and its parameters against the model and the limits; returns
        (prompt text or None, prompt token ids). Raises ValueError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        policy = self.config.scheduler.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(
                f"priority={priority} needs scheduling_policy='priority' (this engine uses "
                f"{policy!r})"
            )
        limits = self.limits
        if params.n > limits.max_n:
            raise ValueError(f"SamplingParams.n must be <= max_n={limits.max_n}, got {params.n}")
        cap = limits.max_output_tokens
        if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
            raise ValueError(
                f"SamplingParams.max_tokens must be <= max_output_tokens={cap}, "
                f"got {params.max_tokens}"
            )
        if params.logprobs is not None and params.logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(
                f"SamplingParams.logprobs must be <= {MAX_TOP_LOGPROBS}, got {params.logprobs}"
            )
        prompt_text, prompt_ids = self._tokenize(prompt)
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, longer than max_model_len="
                f"{self.max_model_len}"
            )
        if limits.max_prompt_len is not None and len(prompt_ids) > limits.max_prompt_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, more than max_prompt_len="
                f"{limits.max_prompt_len}"
            )
        return prompt_text, prompt_ids

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            ids = list(self.tokenizer(prompt)["input_ids"])
            text = prompt
        elif isinstance(prompt, Sequence | np.ndarray):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad or not all(isinstance(t, int | np.integer) for t in prompt):
                raise ValueError(
                    f"prompt token ids must be integers in [0, {self.spec.vocab_size}); "
                    f"got {bad[:5]}"
                )
            text = None
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}")
        if not ids:
            raise ValueError("prompt is empty")
        return text, ids

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
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        from jaxcb.runtime.step_input import pack_step_input

        num_tokens = sched.num_tokens
        # A padded-batch baseline's padding is run too (engine/baselines.py); 0 otherwise.
        bucket = pick_bucket(self.buckets, num_tokens + sched.num_padding_tokens, len(sched.chunks))
        inp = pack_step_input(
            sched,
            bucket,
            page_size=self.page_size,
            pages_per_seq=self.pages_per_seq,
            max_model_len=self.max_model_len,
            num_top_logprobs=MAX_TOP_LOGPROBS,
        )
        t1 = time.perf_counter()
        result = self.runner.execute(bucket, inp)
        t2 = time.perf_counter()
        self.scheduler.update_after_step(sched)
        outputs = self._process_results(sched, result)
        t3 = time.perf_counter()

        self._stats["steps"] += 1
        self._stats["tokens_scheduled"] += num_tokens
        self._stats["token_slots"] += bucket.num_tokens
        self._stats["preemptions"] += len(sched.preempted)
        self._stats["prefix_queries"] += sched.num_prefix_query_tokens
        self._stats["prefix_hits"] += sched.num_prefix_hit_tokens
        self._bucket_hist[bucket.num_tokens] += 1
        self._stats["host_seconds"] += (t1 - t0) + (t3 - t2)
        self._stats["device_seconds"] += t2 - t1
        if self.step_trace is not None:
            self.step_trace.append(self._trace_entry(sched, bucket.num_tokens))
        return outputs

    def _process_results(self, sched: SchedulerOutput, result: Any) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, _Group] = {}
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

    def _append_sample(self, req: Request, group: _Group, result: Any, s: int, now: float) -> None:
        """The token sampled for row s: append it, detokenize, check every stop condition."""
        token = int(result.token_ids[s])
        req.append_token(token)
        req.output_logprobs.append(float(result.logprobs[s]))
        k = req.params.logprobs or 0
        if k > 0 and result.top_token_ids is not None:
            req.output_top_logprobs.append(
                {
                    int(t): float(v)
                    for t, v in zip(
                        result.top_token_ids[s, :k], result.top_logprobs[s, :k], strict=True
                    )
                }
            )
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        self._stats["generated_tokens"] += 1
        detok = group.detokenizers[group.children.index(req)]
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

    def _output(self, group: _Group, now: float) -> RequestOutput:
        """The group's output; a finished group is forgotten. If building it fails, the
        group's unfinished requests fail (and its texts are dropped) rather than the loop."""
        try:
            out = self._make_output(group)
        except Exception as exc:
            for child in group.children:
                if not child.finished:
                    self._fail_request(child, exc, now)
                elif child.error is None:
                    child.error = f"{type(exc).__name__}: {exc}"
            group.broken = True
            out = self._make_output(group)
        if group.finished:
            self._groups.pop(group.request_id, None)
            for child in group.children:
                self._request_group.pop(id(child), None)
        return out

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for j, (req, detok) in enumerate(zip(group.children, group.detokenizers, strict=True)):
            want = req.params.logprobs is not None
            outs.append(
                CompletionOutput(
                    index=j,
                    text="" if group.broken else detok.visible_text(req.finished),
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=list(req.output_logprobs) if want else None,
                    top_logprobs=list(req.output_top_logprobs) if want else None,
                )
            )
        first = group.children[0].metrics
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(
                (c.metrics.first_token_time for c in group.children if c.metrics.first_token_time),
                default=None,
            ),
            last_token_time=max(
                (c.metrics.last_token_time for c in group.children if c.metrics.last_token_time),
                default=None,
            ),
            finished_time=first.finished_time if group.finished else None,
            num_preemptions=sum(c.metrics.num_preemptions for c in group.children),
        )
        if group.finished:
            metrics.finished_time = max(c.metrics.finished_time or 0.0 for c in group.children)
        errors = list(dict.fromkeys(c.error for c in group.children if c.error))
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            metrics=metrics,
            error="; ".join(errors) or None,
            num_cached_tokens=group.children[0].num_cached_tokens or 0,
        )

    # ---- introspection ------------------------------------------------------------------

    def _trace_entry(self, sched: SchedulerOutput, bucket_tokens: int) -> dict[str, Any]:
        return {
            "bucket": bucket_tokens,
            "chunks": [
                (
                    c.request.request_id,
                    c.num_tokens,
                    # from the chunk alone: the request has moved on by now
                    "decode"
                    if c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens
                    else "prefill",
                )
                for c in sched.chunks
            ],
            "num_tokens": sched.num_tokens,
            "batch_padding": sched.num_padding_tokens,
            "pages_used": self.pool.num_used,
            "preempted": [r.request_id for r in sched.preempted],
            "prefix_queries": sched.num_prefix_query_tokens,
            "prefix_hits": sched.num_prefix_hit_tokens,
        }

    def check_page_invariant(self) -> None:
        self.pool.check_invariant(self.scheduler.owners())

    def check_health(self) -> None:
        """Raise RuntimeError if the engine cannot run further steps: a failed step consumed
        its donated KV buffers, or the page accounting is broken."""
        import jax

        leaves = jax.tree_util.tree_leaves(self.runner.state)
        if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in leaves):
            raise RuntimeError("the device KV cache was lost in a failed step")
        try:
            self.check_page_invariant()
        except RuntimeError as exc:
            raise RuntimeError(f"the KV page accounting is broken: {exc}") from exc

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no request holds; returns how many were dropped."""
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        s = self._stats
        slots = s["token_slots"]
        return {
            "steps": s["steps"],
            "requests": s["requests"],
            "aborted": s["aborted"],
            "prompt_tokens": s["prompt_tokens"],
            "generated_tokens": s["generated_tokens"],
            "bucket_histogram": dict(sorted(self._bucket_hist.items())),
            "padding_fraction": (slots - s["tokens_scheduled"]) / slots if slots else 0.0,
            "compile_seconds": self.compile_seconds,
            "compile_cache": dict(self.compile_cache),
            "compile_seconds_per_bucket": dict(self.runner.compile_seconds),
            "preemptions": s["preemptions"],
            "failed": s["failed"],
            "prefix_queries": s["prefix_queries"],
            "prefix_hits": s["prefix_hits"],
            "prefix_hit_rate": s["prefix_hits"] / s["prefix_queries"]
            if s["prefix_queries"]
            else 0.0,
            "kv_pages_total": self.num_pages,
            "kv_pages_used": self.pool.num_used,
            "kv_pages_peak": self.pool.peak_used,
            "kv_pages_cached": self.pool.num_cached,
            "kv_pages_evicted": self.pool.num_evictions,
            "host_seconds": s["host_seconds"],
            "device_seconds": s["device_seconds"],
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
        }
