"""The contracts of the host side: what it sees of the device side, and what it offers.

    Runner       the device side as the engine sees it: pack a scheduled step into the
                 bucket's arrays, run it, say whether the device state survived
                 (runtime/runner.py implements it; runtime/setup.py builds it)
    StepResult   what one step gives back: the sampled tokens and their logprobs, and the
                 prompt logprobs its prefill rows computed
    EngineInfo   facts about the loaded model and the runtime, for logs, stats and the server
    StepRecord   what one step held, for per-step metrics and step traces
    KVUsage      the KV page pool's figures
    Engine       the interface LLMEngine and ReplicatedEngine share (LLM, the server and
                 batch inference drive either)

Nothing here imports jax: the host side builds on these types alone.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket
from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.engine.sched.schedule import SchedulerOutput
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # top logprobs a step computes per row at most (as the OpenAI API)


@dataclass
class StepResult:
    """What the host needs back from one step (numpy, sequence rows; then the prompt
    logprob rows, in the order of the chunks and their positions: see
    ScheduledChunk.prompt_logprob_positions)."""

    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray  # f32[S]
    top_token_ids: np.ndarray | None  # i32[S, K] when any row asked for top logprobs
    top_logprobs: np.ndarray | None  # f32[S, K]
    prompt_logprobs: np.ndarray | None = None  # f32[N]: when some chunk asked for them
    prompt_top_token_ids: np.ndarray | None = None  # i32[N, K]: when one asked for top-k
    prompt_top_logprobs: np.ndarray | None = None  # f32[N, K]


class Runner(Protocol):
    """The device side of one engine: params, KV pages and a compiled step per bucket."""

    def prepare(self, sched: SchedulerOutput, bucket: Bucket) -> Any:
        """Lay the scheduled chunks out in the bucket's fixed-shape arrays (host work)."""
        ...

    def execute(self, bucket: Bucket, prepared: Any) -> StepResult:
        """Run the bucket's compiled step on `prepare`'s arrays; wait for the tokens."""
        ...

    def dispatch(self, bucket: Bucket, prepared: Any) -> Any:
        """`execute`'s first half: start the step, return a handle without waiting for it
        (async scheduling). Rows whose chunk has a `prev_sample_row` take their last input
        token from the previous dispatched step's sampled tokens, on the device. Only
        needed with `scheduler.async_scheduling`."""
        ...

    def collect(self, handle: Any) -> StepResult:
        """`execute`'s second half: wait for a dispatched step, read back its results."""
        ...

    def check_health(self) -> None:
        """RuntimeError if the device state was lost (a failed step consumed its buffers)."""
        ...

    def background_compile(self) -> tuple[int, float]:
        """(programs still compiling on a background thread, seconds spent on those done)
        when the engine was made ready before every bucket was compiled; else (0, 0.0)."""
        ...

    def close(self) -> None:
        """Stop a background compile (the step programs' compiles are all it holds)."""
        ...

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Copy KV pages to host slots, (page, slot) pairs, then host slots into pages,
        (slot, page) pairs (preemption by swap, engine/sched/swap.py). The engine calls it after
        `schedule()` and before `execute`, so the copies out read the pages before the step
        (or a later one) writes them, and the copies in land before the step reads them."""
        ...

    def read_lora(self, path: str) -> Any:
        """The PEFT adapter in `path` read and checked, ready for `add_lora` (host work
        only, callable from any thread); ValueError (one line) if it does not fit the base
        model or LoRA is off."""
        ...

    def add_lora(self, lora_id: int, path: str, values: Any = None) -> None:
        """Keep an adapter on the host as `lora_id` (a repeated id: kept as it is): `values`
        from `read_lora`, else read from `path` now."""
        ...

    def remove_lora(self, lora_id: int) -> None:
        """Drop the host copy of an adapter (no slot may hold it any more)."""
        ...

    def load_lora_slot(self, slot: int, lora_id: int) -> None:
        """Write an added adapter into device slot `slot` (1..max_loras), before the step
        whose rows use it runs (the engine calls it after `schedule()`, as `swap`)."""
        ...


@dataclass(frozen=True)
class EngineInfo:
    """The loaded model and the runtime around it, as the composition root built them."""

    model_path: str
    model_name: str  # the model as the user named it (the server's default served name)
    model_format: str  # "safetensors" (Hugging Face), "gguf" or "orbax"
    random_weights: bool  # the built-in tiny random-weight model (its text is noise)
    architecture: str  # Hugging Face class name
    vocab_size: int
    max_model_len: int
    buckets: tuple[Bucket, ...]
    page_size: int
    num_pages: int
    kv_cache_bytes: int
    kv_cache_dtype: str
    attention_backend: str
    matmul_backend: str
    platform: str  # jax's backend: cpu, gpu, tpu
    load_seconds: float
    compile_seconds: float
    compile_seconds_per_bucket: dict[int, float] = field(default_factory=dict)
    compile_cache: dict[str, Any] = field(default_factory=dict)
    # On CPU: the CPU and its relevant flags, the ISA level the native kernels run at, and
    # each native matmul kernel with why it is not the one in use ("in use" for that one).
    cpu_kernels: dict[str, Any] = field(default_factory=dict)
    # Preemption by swap: host slots of one KV page each (0: no swap), and the device-host
    # bandwidth measured at start-up (bytes/s, one direction; 0.0: not measured).
    num_swap_pages: int = 0
    swap_bytes_per_s: float = 0.0
    # LoRA: the device's adapter slots and their rank (0: LoRA off; jaxcb/lora.py).
    max_loras: int = 0
    max_lora_rank: int = 0
    kv_pool_sizing: str = ""  # how num_pages was decided (runtime/kv_cache.py's PoolSizing)
    quantization: str = "none"  # of the weights (EngineConfig.quantization)
    weight_bytes: int = 0  # the weights as stored on the devices (all of them)
    # one token's K and V over all layers, a quantized pool's scales included (all devices)
    kv_bytes_per_token: int = 0

    @property
    def token_buckets(self) -> list[int]:
        return sorted({b.num_tokens for b in self.buckets})


@dataclass(frozen=True)
class StepRecord:
    """One step: its bucket (token slots), its chunks as (request id, tokens, "prefill" |
    "decode"), the real tokens, a padded-batch baseline's batch padding, KV pages in use
    after it, the requests it preempted, the prefix cache's lookups and hits, and the token
    budget it was scheduled under (the ITL controller's choice, else max_num_batched_tokens)."""

    bucket: int
    chunks: tuple[tuple[str, int, str], ...]
    num_tokens: int
    batch_padding: int
    pages_used: int
    preempted: tuple[str, ...]
    prefix_queries: int
    prefix_hits: int
    token_budget: int = 0  # 0: not known (a record built without one)
    recomputed_tokens: int = 0  # computed tokens its preemptions dropped
    admitted_idle_pages: int = 0  # pages promised to running requests, not yet allocated
    predicted_output_len: int | None = None  # what `predicted` admission expects
    # Preemption by swap: victims swapped out, swapped requests resumed, victims recomputed
    # because the host pool was full.
    swapped_out: int = 0
    swapped_in: int = 0
    swap_fallbacks: int = 0
    replica: int | None = None  # data-parallel replica that ran it

    @classmethod
    def of(
        cls, sched: SchedulerOutput, bucket_tokens: int, pages_used: int, token_budget: int = 0
    ) -> StepRecord:
        return cls(
            bucket=bucket_tokens,
            chunks=tuple(
                (
                    c.request.request_id,
                    c.num_tokens,
                    # from the chunk alone: the request has moved on by now (a decode's
                    # tokens count its proposals: speculative decoding)
                    "decode"
                    if c.num_tokens == 1 + c.num_draft_tokens
                    and c.start >= c.request.num_prompt_tokens
                    else "prefill",
                )
                for c in sched.chunks
            ),
            num_tokens=sched.num_tokens,
            batch_padding=sched.num_padding_tokens,
            pages_used=pages_used,
            preempted=tuple(r.request_id for r in sched.preempted),
            prefix_queries=sched.num_prefix_query_tokens,
            prefix_hits=sched.num_prefix_hit_tokens,
            token_budget=token_budget,
            recomputed_tokens=sched.num_recomputed_tokens,
            admitted_idle_pages=sched.admitted_idle_pages,
            predicted_output_len=sched.predicted_output_len,
            swapped_out=sched.num_swapped_out,
            swapped_in=sched.num_swapped_in,
            swap_fallbacks=sched.num_swap_fallbacks,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of a step trace entry (jaxcb.engine.step_trace)."""
        out = {
            "bucket": self.bucket,
            "chunks": [list(c) for c in self.chunks],
            "num_tokens": self.num_tokens,
            "batch_padding": self.batch_padding,
            "pages_used": self.pages_used,
            "preempted": list(self.preempted),
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "token_budget": self.token_budget,
            "recomputed_tokens": self.recomputed_tokens,
            "admitted_idle_pages": self.admitted_idle_pages,
            "swapped_out": self.swapped_out,
            "swapped_in": self.swapped_in,
            "swap_fallbacks": self.swap_fallbacks,
        }
        if self.replica is not None:
            out["replica"] = self.replica
        return out


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding so far (vLLM's spec_decode counters): proposals verified (one
    per request and step), their tokens, and of those the ones kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified proposal brought: the kept ones and the target's next (0.0
        before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class KVUsage:
    num_pages: int
    num_used: int
    num_cached: int  # cached prefix pages nobody holds (free to evict)
    peak_used: int  # with replicas: the sum of each one's peak, an upper bound
    num_evictions: int
    num_swap_pages: int = 0  # host slots for swapped-out KV pages (engine/sched/swap.py)
    num_swap_used: int = 0  # of them, held by swapped-out requests now

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages if self.num_pages else 0.0


class Engine(abc.ABC):
    """Requests in, outputs out, one step at a time. `config`, `info` and `tokenizer` are
    plain attributes; the rest is below."""

    config: EngineConfig
    info: EngineInfo
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)

    @abc.abstractmethod
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
        """Validate and queue a request; returns its id (ValueError for bad input).
        `lora_request`: the LoRA adapter it runs with (None: the base model)."""

    def read_lora(self, lora: LoRARequest) -> Any:
        """The adapter's weights read and checked for `add_lora(lora, values)`: host work,
        callable off the engine's thread; ValueError (one line) if they cannot be."""
        raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True")

    def add_lora(self, lora: LoRARequest, values: Any = None) -> Any:
        """Make a LoRA adapter known (read, checked against the model, unless `values`
        from `read_lora` are given); ValueError (one line) if it cannot be, or if the engine
        serves no adapters."""
        raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True")

    def remove_lora(self, lora_int_id: int) -> LoRARequest:
        """Forget a LoRA adapter; ValueError if it is unknown or in use."""
        raise ValueError(f"no LoRA adapter has lora_int_id {lora_int_id}")

    def list_loras(self) -> list[LoRARequest]:
        """The LoRA adapters known, in the order they were added."""
        return []

    def lora_counts(self) -> tuple[int, int]:
        """(LoRA adapters known, adapters written into a device slot so far)."""
        return 0, 0

    @abc.abstractmethod
    def validate_request(
        self, prompt: str | Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids), or ValueError naming the problem."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None for unknown or finished ids."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one iteration; outputs of the requests that got tokens or finished."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @property
    @abc.abstractmethod
    def num_running(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int: ...

    @abc.abstractmethod
    def kv_usage(self) -> KVUsage: ...

    @abc.abstractmethod
    def spec_decode_counts(self) -> SpecDecodeCounts:
        """Speculative decoding's counters (all zero without it)."""

    @abc.abstractmethod
    def record_steps(self, on: bool = True) -> None:
        """Start (or stop) keeping a StepRecord of every step, for `pop_step_records`."""

    @abc.abstractmethod
    def pop_step_records(self) -> list[StepRecord]:
        """The records kept since the last call (oldest first), and forget them."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Steps, buckets, padding, compile seconds, KV pages, preemptions, prefix cache."""

    @abc.abstractmethod
    def check_page_invariant(self) -> None: ...

    @abc.abstractmethod
    def check_health(self) -> None:
        """RuntimeError if the engine cannot run further steps."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> int:
        """Forget every cached page no request holds; returns how many were dropped."""

    def close(self) -> None:  # noqa: B027 (optional: most engines hold nothing to release)
        """Release threads or other resources (nothing by default)."""

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len
