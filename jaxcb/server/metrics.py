"""Prometheus metrics of the server, named like vLLM's where they mean the same thing.

Everything is updated from the engine loop thread (prometheus-client metrics are thread-safe)
and lives in the server's own registry, so several apps in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxcb.engine.interface import EngineInfo, SpecDecodeCounts, StepRecord
from jaxcb.engine.request import RequestMetrics

# Histogram bounds in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480, 960)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metrics, each already bound to its `model_name` label."""

    def __init__(self, model_name: str, token_buckets: Sequence[int]) -> None:
        self.registry = registry = CollectorRegistry()
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(
                model_name
            )

        self.num_requests_running = gauge(
            "jaxcb:num_requests_running", "Sequences in the running batch (one per sample)."
        )
        self.num_requests_waiting = gauge(
            "jaxcb:num_requests_waiting", "Sequences waiting to be admitted (one per sample)."
        )
        self.kv_cache_usage_perc = gauge(
            "jaxcb:kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = all)."
        )
        self.padding_fraction = gauge(
            "jaxcb:padding_fraction",
            "Fraction of the token slots of all steps so far that were padding.",
        )
        self.time_to_first_token = histogram(
            "jaxcb:time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "jaxcb:inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a sequence.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "jaxcb:e2e_request_latency_seconds",
            "Seconds from arrival to the end of a request that was not aborted.",
            E2E_BUCKETS,
        )
        # A finished request's phases, from the engine's own clock (RequestMetrics).
        self.request_queue_time = histogram(
            "jaxcb:request_queue_time_seconds",
            "Seconds a request waited from arrival until its first step.",
            E2E_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "jaxcb:request_prefill_time_seconds",
            "Seconds from a request's first step to its first generated token.",
            E2E_BUCKETS,
        )
        self.request_decode_time = histogram(
            "jaxcb:request_decode_time_seconds",
            "Seconds from a request's first generated token to its last.",
            E2E_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "jaxcb:request_time_per_output_token_seconds",
            "A request's decode time over its generated tokens after the first (TPOT).",
            ITL_BUCKETS,
        )
        self.step_bucket_tokens = histogram(
            "jaxcb:step_bucket_tokens",
            "Token bucket (padded batch size) chosen for each engine step.",
            sorted(set(token_buckets)),
        )
        self.prefill_budget_tokens = gauge(
            "jaxcb:prefill_budget_tokens",
            "Token budget of the latest step: the ITL controller's choice among the token "
            "buckets (itl_target_ms), else max_num_batched_tokens.",
        )
        self.prompt_tokens = counter("jaxcb:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("jaxcb:generation_tokens", "Generated tokens.")
        self.num_preemptions = counter(
            "jaxcb:num_preemptions", "Sequences preempted (pages freed, recomputed later)."
        )
        self.recomputed_tokens = counter(
            "jaxcb:recomputed_tokens",
            "Computed tokens whose K/V preemptions dropped (computed again on resuming).",
        )
        self.admitted_idle_pages = gauge(
            "jaxcb:admitted_idle_pages",
            "KV pages admission promised to running requests that hold no K/V yet "
            "(reserve and predicted admission; 0 with greedy).",
        )
        self.predicted_output_len = gauge(
            "jaxcb:predicted_output_len",
            "Output tokens predicted admission reserves for: the admission_quantile of "
            "recent output lengths (0 until a request finishes).",
        )
        self.swapped_out_requests = counter(
            "jaxcb:swapped_out_requests",
            "Preempted sequences whose KV pages were copied to host memory (preemption_mode "
            "swap or auto).",
        )
        self.swapped_in_requests = counter(
            "jaxcb:swapped_in_requests",
            "Swapped-out sequences resumed with their KV pages copied back.",
        )
        self.swap_fallbacks = counter(
            "jaxcb:swap_fallbacks",
            "Preempted sequences recomputed because the host swap pool was full.",
        )
        self.swap_pages_used = gauge(
            "jaxcb:swap_pages_used", "Host KV pages held by swapped-out sequences."
        )
        self.prefix_cache_queries = counter(
            "jaxcb:prefix_cache_queries",
            "Tokens looked up in the prefix cache (every token of each admitted sequence).",
        )
        self.prefix_cache_hits = counter(
            "jaxcb:prefix_cache_hits", "Of the looked-up tokens, those found cached."
        )
        # speculative decoding, as vLLM's spec_decode counters
        self.spec_decode_num_drafts = counter(
            "jaxcb:spec_decode_num_drafts",
            "Speculative decoding: proposals verified (one per request and step).",
        )
        self.spec_decode_num_draft_tokens = counter(
            "jaxcb:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "jaxcb:spec_decode_num_accepted_tokens",
            "Speculative decoding: proposed tokens the target model's samples kept.",
        )
        self.spec_decode_mean_acceptance_length = gauge(
            "jaxcb:spec_decode_mean_acceptance_length",
            "Speculative decoding: tokens a verified proposal brought on average (the kept "
            "ones and the target's own next token), since start.",
        )
        self.weight_bytes = gauge(
            "jaxcb:weight_bytes", "Bytes of the model weights as stored on the devices."
        )
        self.kv_cache_bytes = gauge(
            "jaxcb:kv_cache_bytes",
            "Bytes of the KV page pool (K and V of every layer; quantized pages' scales included).",
        )
        self.kv_bytes_per_token = gauge(
            "jaxcb:kv_bytes_per_token",
            "Bytes one token's K and V take over all layers (a quantized pool's float32 "
            "scale per KV head included).",
        )
        self.num_kv_pages = gauge("jaxcb:num_kv_pages", "KV pages in the pool.")
        self._cache_config = Gauge(
            "jaxcb:cache_config_info",
            "The KV cache's configuration, in the labels (value 1).",
            ["model_name", "kv_cache_dtype", "page_size", "num_pages"],
            registry=registry,
        )
        self._request_success = Counter(
            "jaxcb:request_success",
            "Finished sequences by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.lora_adapters = gauge(
            "jaxcb:lora_adapters", "LoRA adapters the server knows (loaded on the host)."
        )
        self.lora_slot_loads = counter(
            "jaxcb:lora_slot_loads",
            "LoRA adapters written into a device slot (first loads and LRU swaps).",
        )
        self._lora_requests = Counter(
            "jaxcb:lora_requests",
            "Sequences (prompts x n) admitted per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=registry,
        )
        self._lora_loads_seen = 0
        self._model_name = model_name
        self._token_slots = 0
        self._spec_decode = SpecDecodeCounts()  # the engine's counters when last read
        self._tokens_scheduled = 0
        self._idle_pages: dict[int | None, int] = {}  # per data-parallel replica

    def engine_info(self, info: EngineInfo) -> None:
        """Set the gauges of what the engine is: its weights and KV pool (dtype, pages,
        bytes a token)."""
        self.weight_bytes.set(info.weight_bytes)
        self.kv_cache_bytes.set(info.kv_cache_bytes)
        self.kv_bytes_per_token.set(info.kv_bytes_per_token)
        self.num_kv_pages.set(info.num_pages)
        labels = (info.kv_cache_dtype, str(info.page_size), str(info.num_pages))
        self._cache_config.labels(self._model_name, *labels).set(1)

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()

    def request_phases(self, times: RequestMetrics, num_output_tokens: int) -> None:
        """A finished request's queue, prefill and decode times and its time per output
        token, each where the engine recorded both of its ends."""
        first_step, first, last = (
            times.first_scheduled_time,
            times.first_token_time,
            times.last_token_time,
        )
        if first_step is not None:
            self.request_queue_time.observe(first_step - times.arrival_time)
            if first is not None:
                self.request_prefill_time.observe(first - first_step)
        if first is not None and last is not None:
            self.request_decode_time.observe(last - first)
            if num_output_tokens > 1:
                self.request_time_per_output_token.observe((last - first) / (num_output_tokens - 1))

    def step(self, record: StepRecord) -> None:
        """Record one engine step: its bucket, real tokens, preemptions and the tokens they
        dropped, swaps to host memory, prefix cache use, admission's idle pages and output
        length prediction."""
        self.step_bucket_tokens.observe(record.bucket)
        if record.token_budget:
            self.prefill_budget_tokens.set(record.token_budget)
        self._token_slots += record.bucket
        self._tokens_scheduled += record.num_tokens
        self.padding_fraction.set(1.0 - self._tokens_scheduled / self._token_slots)
        if record.preempted:
            self.num_preemptions.inc(len(record.preempted))
        if record.recomputed_tokens:
            self.recomputed_tokens.inc(record.recomputed_tokens)
        self._idle_pages[record.replica] = record.admitted_idle_pages
        self.admitted_idle_pages.set(sum(self._idle_pages.values()))
        if record.predicted_output_len is not None:
            self.predicted_output_len.set(record.predicted_output_len)
        if record.swapped_out:
            self.swapped_out_requests.inc(record.swapped_out)
        if record.swapped_in:
            self.swapped_in_requests.inc(record.swapped_in)
        if record.swap_fallbacks:
            self.swap_fallbacks.inc(record.swap_fallbacks)
        if record.prefix_queries:
            self.prefix_cache_queries.inc(record.prefix_queries)
            self.prefix_cache_hits.inc(record.prefix_hits)

    def spec_decode(self, counts: SpecDecodeCounts) -> None:
        """The engine's speculative decoding counters now (`Engine.spec_decode_counts`)."""
        last, self._spec_decode = self._spec_decode, counts
        if counts.num_drafts == last.num_drafts:
            return
        self.spec_decode_num_drafts.inc(counts.num_drafts - last.num_drafts)
        self.spec_decode_num_draft_tokens.inc(counts.num_draft_tokens - last.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(
            counts.num_accepted_tokens - last.num_accepted_tokens
        )
        self.spec_decode_mean_acceptance_length.set(counts.mean_acceptance_length)

    def lora(self, num_adapters: int, num_loads: int) -> None:
        """The engine's LoRA counts now (`Engine.lora_counts`)."""
        self.lora_adapters.set(num_adapters)
        if num_loads > self._lora_loads_seen:
            self.lora_slot_loads.inc(num_loads - self._lora_loads_seen)
            self._lora_loads_seen = num_loads

    def lora_requests(self, lora_name: str, num_sequences: int) -> None:
        self._lora_requests.labels(self._model_name, lora_name).inc(num_sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
