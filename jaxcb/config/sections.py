"""The sections of an engine's configuration: the KV page pool, scheduling, kernels, limits
and parallelism. Each is a frozen dataclass whose fields are checked at construction
(ValueError naming the field); the trailing comment of a field is its --help text."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from jaxcb.config.values import check as _check
from jaxcb.config.values import check_types as _check_types

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "fp8")  # weight quantization (jaxcb/models/quant.py)
# KV page dtypes: the float ones, or quantized codes with a float32 scale per token and KV
# head (pallas_kernels/ragged_paged_attention/kv_quant.py); "fp8" is fp8_e4m3, as in vLLM.
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", *DTYPES, *QUANTIZED_KV_CACHE_DTYPES)
ATTENTION_BACKENDS = ("auto", "native", "xla", "pallas", "pallas-tpu", "pallas-gpu")
MATMUL_BACKENDS = ("auto", "amx", "avx512_bf16", "avx512", "avx2_bf16", "avx2", "xla")
ADMISSION_MODES = ("greedy", "reserve", "predicted")
BATCHING_MODES = ("continuous", "static", "dynamic")
PREEMPTION_MODES = ("recompute", "swap", "auto")
SPECULATIVE_METHODS = ("none", "ngram", "draft_model")


@dataclass(frozen=True)
class CacheConfig:
    """KV page pool. Size it with `num_pages`, or `kv_cache_memory_gb`, or neither (auto)."""

    SECTION: ClassVar[str] = "cache"

    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # pages in the pool (per layer)
    kv_cache_memory_gb: float | None = None  # K+V bytes for all layers, in GiB
    memory_utilization: float = 0.9  # share of free accelerator memory auto sizing may use
    # KV page dtype. auto: the model dtype (float32 with attention xla on CPU). int8, fp8 (=
    # fp8_e4m3, as in vLLM) and fp8_e5m2 store codes with a float32 scale per token and KV head.
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | int8 | fp8 | fp8_e4m3 | fp8_e5m2
    enable_prefix_caching: bool = True  # share cached full pages of common prompt prefixes
    swap_space_gb: float = 4.0  # host memory for KV pages swapped out on preemption, GiB; 0: none

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        _check(
            self.num_pages is None or self.num_pages >= 1,
            f"num_pages must be >= 1, got {self.num_pages}",
        )
        _check(
            self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
            f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}",
        )
        _check(
            self.num_pages is None or self.kv_cache_memory_gb is None,
            "give num_pages or kv_cache_memory_gb, not both",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        _check(
            0 < self.memory_utilization <= 1,
            f"memory_utilization must be in (0, 1], got {self.memory_utilization}",
        )
        _check(
            0 <= self.swap_space_gb < math.inf,
            f"swap_space_gb must be >= 0 (0: no swap), got {self.swap_space_gb}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling under a token budget."""

    SECTION: ClassVar[str] = "scheduler"

    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 512  # tokens per step at most (the largest bucket)
    # Precompiled token buckets; None = powers of two from 16 (from 1 where XLA's CPU dots
    # run the matmuls: they compute padding rows) up to max_num_batched_tokens.
    token_buckets: tuple[int, ...] | None = None
    # Sequence-row sizes compiled for each token bucket besides min(T, max_num_seqs): a step
    # with few sequences (a lone prompt's prefill) then runs the lm_head and sampling on few
    # rows, not on max_num_seqs padded ones. Each extra size adds a compile per token bucket.
    seq_buckets: tuple[int, ...] = (16,)
    # fcfs | priority (lower value first) | srpf | edf: engine/sched/policies.py's names,
    # checked when the engine is built
    scheduling_policy: str = "fcfs"
    srpf_aging: float = 16.0  # srpf: tokens a waiting request gains on newer ones per step
    ttft_target_ms: float | None = None  # time-to-first-token target of requests giving none
    tpot_target_ms: float | None = None  # time-per-output-token target of requests giving none
    edf_late_penalty_ms: float = 5000.0  # edf: how far a request that missed its deadline falls
    admission: str = "greedy"  # greedy | reserve (prompt + max_tokens) | predicted
    admission_quantile: float = 0.9  # predicted: quantile of observed output lengths reserved
    long_prefill_token_threshold: int = 0  # prefill tokens per request per step; 0: no cap
    # A step's tokens while requests decode: max_num_batched_tokens over their number, at
    # least this (a whole prompt in one step when one request decodes, small chunks that keep
    # the ITL of many short); 0: max_num_batched_tokens always. itl_target_ms overrides it.
    min_token_budget: int = 0  # token budget floor with running decodes; 0: no sharing
    # ITL controller (engine/sched/itl_controller.py): each step's token budget picked among the
    # token buckets from the measured inter-token latency; None: the fixed budget.
    itl_target_ms: float | None = None  # inter-token latency target, ms; None: controller off
    itl_percentile: float = 0.9  # ITL controller: percentile held under the target (p90, p99)
    itl_window: int = 64  # ITL controller: decode steps per window (p99 wants a few hundred)
    itl_min_prefill_tokens: int = 16  # ITL controller: prefill tokens a step may always take
    watermark: float = 0.01  # pages admission leaves free: a fraction (< 1) or a count
    # What a preempted request's KV pages become: recompute (freed, prefilled again later),
    # swap (copied to host memory, swap_space_gb, and back), auto (the cheaper, per request).
    preemption_mode: str = "recompute"  # recompute | swap | auto
    batching: str = "continuous"  # continuous | static | dynamic (padded-batch baselines)
    # Schedule and pack step N+1 while the device runs step N; step N's tokens are read back
    # after N+1 is dispatched, and decode rows take their input token on device. The same
    # tokens; runs synchronously with swap preemption, the ITL controller or a baseline.
    # None: on wherever the engine can overlap (engine/inflight.py's sync_reason), silently
    # off where it cannot; True: the same, with a warning where it cannot; False: off.
    async_scheduling: bool | None = None  # overlap host scheduling with the device step

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.batching in BATCHING_MODES,
            f"batching must be one of {list(BATCHING_MODES)}, got {self.batching!r}",
        )
        _check(self.srpf_aging > 0, f"srpf_aging must be > 0, got {self.srpf_aging}")
        _check(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {list(PREEMPTION_MODES)}, "
            f"got {self.preemption_mode!r}",
        )
        for name in ("ttft_target_ms", "tpot_target_ms"):
            value = getattr(self, name)
            _check(value is None or 0 < value < math.inf, f"{name} must be > 0, got {value}")
        _check(
            0 < self.edf_late_penalty_ms < math.inf,
            f"edf_late_penalty_ms must be > 0, got {self.edf_late_penalty_ms}",
        )
        _check(
            self.admission in ADMISSION_MODES,
            f"admission must be one of {list(ADMISSION_MODES)}, got {self.admission!r}",
        )
        _check(
            0 < self.admission_quantile <= 1,
            f"admission_quantile must be in (0, 1], got {self.admission_quantile}",
        )
        _check(
            self.itl_target_ms is None or self.itl_target_ms > 0,
            f"itl_target_ms must be > 0 (None: controller off), got {self.itl_target_ms}",
        )
        _check(
            0 < self.itl_percentile < 1,
            f"itl_percentile must be in (0, 1), got {self.itl_percentile}",
        )
        _check(self.itl_window >= 2, f"itl_window must be >= 2, got {self.itl_window}")
        _check(
            self.itl_min_prefill_tokens >= 1,
            f"itl_min_prefill_tokens must be >= 1, got {self.itl_min_prefill_tokens}",
        )
        _check(
            self.itl_target_ms is None or self.batching == "continuous",
            f"itl_target_ms needs batching='continuous' (a padded batch has no token budget "
            f"to steer), got batching={self.batching!r}",
        )
        _check(
            0 <= self.min_token_budget <= self.max_num_batched_tokens,
            f"min_token_budget must be in [0, max_num_batched_tokens="
            f"{self.max_num_batched_tokens}], got {self.min_token_budget}",
        )
        _check(
            self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0 (0: no cap), "
            f"got {self.long_prefill_token_threshold}",
        )
        _check(
            self.watermark >= 0 and (self.watermark < 1 or self.watermark == int(self.watermark)),
            f"watermark must be a fraction of the pages in [0, 1) or a whole number of pages, "
            f"got {self.watermark}",
        )
        _check(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({self.max_num_seqs}) so every running request can decode in each step",
        )
        seq_buckets = tuple(int(b) for b in self.seq_buckets)
        object.__setattr__(self, "seq_buckets", seq_buckets)
        _check(
            all(b >= 1 for b in seq_buckets),
            f"seq_buckets must be positive, got {list(seq_buckets)}",
        )
        if self.token_buckets is not None:
            buckets = tuple(int(b) for b in self.token_buckets)
            object.__setattr__(self, "token_buckets", buckets)
            _check(len(buckets) > 0, "token_buckets must not be empty")
            _check(
                all(b >= 1 for b in buckets) and list(buckets) == sorted(set(buckets)),
                f"token_buckets must be positive and strictly increasing, got {list(buckets)}",
            )
            _check(
                buckets[-1] == self.max_num_batched_tokens,
                f"the largest token bucket ({buckets[-1]}) must equal "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})",
            )

    def watermark_pages(self, num_pages: int) -> int:
        """The watermark as a page count for a pool of `num_pages`."""
        if self.watermark < 1:
            return int(self.watermark * num_pages)
        return int(self.watermark)


@dataclass(frozen=True)
class KernelConfig:
    """Attention backend: "native" (jaxcb's C++ CPU kernels via XLA FFI, built on first use),
    "xla" (plain XLA), "pallas" (the Pallas kernel of this platform: Mosaic on TPU, Triton on
    GPU; on CPU the GPU kernel in interpret mode, for tests), "pallas-tpu" / "pallas-gpu"
    (that kernel; interpret mode on CPU), or "auto" (pallas on TPU and GPU; native on CPU
    when a C++ compiler is found, else xla).

    Matmul path: "amx" (jaxcb's native bf16 kernel on AMX tiles, weights packed at load: CPU,
    bfloat16 weights, no tensor parallelism), "avx512_bf16" (the same with AVX512-BF16 dot
    products, for CPUs without AMX), "avx512" (float32 weights, AVX-512 FMAs), "avx2_bf16"
    (bfloat16 weights widened to float32 in AVX2 registers: any x86 CPU with AVX2 + FMA),
    "avx2" (float32 weights, AVX2 FMAs), "xla", or "auto" (the first native kernel that can
    run, else xla). The environment variable JAXCB_CPU_ISA (avx2, avx512, ...) caps what
    "auto" and the native attention may use.

    greedy_screen: with a float32 native kernel ("avx512", "avx2"), steps whose rows are all
    greedy (no sampling, penalties or logprobs) find each row's token with a bf16 LM head
    and recompute in float32 only the few columns that could hold its maximum: the same
    tokens as the float32 LM head at about half its cost (a bf16 copy of lm_head in memory).

    scan_layers: the step runs the layers as a lax.scan over their stacked weights, so a
    layer is compiled once whatever the model's depth (models/stacking.py); false unrolls
    them over per-layer weights and KV pools (one copy of the layer per layer in every
    program). None: the platform's default (runtime/plan.py's scan_layers_default)."""

    SECTION: ClassVar[str] = "kernels"

    attention: str = "auto"  # auto | native | xla | pallas | pallas-tpu | pallas-gpu
    matmul: str = "auto"  # auto | amx | avx512_bf16 | avx512 | avx2_bf16 | avx2 | xla
    greedy_screen: bool = True
    scan_layers: bool | None = None  # None: the platform's (scanned on CPU and TPU)

    def __post_init__(self) -> None:
        _check_types(self)
        _check(
            self.attention in ATTENTION_BACKENDS,
            f"attention must be one of {list(ATTENTION_BACKENDS)}, got {self.attention!r}",
        )
        _check(
            self.matmul in MATMUL_BACKENDS,
            f"matmul must be one of {list(MATMUL_BACKENDS)}, got {self.matmul!r}",
        )


@dataclass(frozen=True)
class LimitsConfig:
    """What one request, and the server's queue, may ask for; beyond it is a clear error."""

    SECTION: ClassVar[str] = "limits"

    max_waiting_requests: int = 1024  # server: sequences that may wait (a request adds prompts x n)
    max_prompt_len: int | None = None  # prompt tokens at most; None: max_model_len
    max_n: int = 128  # samples per prompt (SamplingParams.n) at most
    max_output_tokens: int | None = None  # max_tokens at most; None: up to max_model_len
    # 128 as max_n: a list of prompts is a small batch; a large job belongs in batch_infer.py
    max_prompts_per_request: int = 128  # server: prompts one /v1/completions request may list

    def __post_init__(self) -> None:
        _check_types(self)
        _check(
            self.max_waiting_requests >= 1,
            f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}",
        )
        _check(
            self.max_prompt_len is None or self.max_prompt_len >= 1,
            f"max_prompt_len must be >= 1, got {self.max_prompt_len}",
        )
        _check(self.max_n >= 1, f"max_n must be >= 1, got {self.max_n}")
        _check(
            self.max_output_tokens is None or self.max_output_tokens >= 1,
            f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
        )
        _check(
            self.max_prompts_per_request >= 1,
            f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Scaling out on JAX's own mesh and distributed runtime (runtime/sharding.py).

    `tensor_parallel_size` devices hold one engine's model, sharded by heads, MLP and
    vocabulary (the KV pages by KV head); `data_parallel_size` independent engines, each on
    its own devices, share the requests (least loaded first). `mesh_shape` is the same as
    the two sizes, as a (data, tensor) mesh. `distributed` calls `jax.distributed.initialize`
    first, for meshes spanning processes (runtime/distributed.py); `heartbeat_timeout_s` is
    how long a silent peer process is waited for before every process exits with an error."""

    SECTION: ClassVar[str] = "parallel"

    tensor_parallel_size: int = 1  # devices one engine is sharded over (heads, MLP, vocab)
    data_parallel_size: int = 1  # independent engine replicas, each on its own devices
    mesh_shape: tuple[int, ...] | None = None  # (data, tensor) sizes; same as the two above
    distributed: bool = False  # multi-host: call jax.distributed.initialize() first
    coordinator_address: str | None = None  # distributed: process 0's host:port; None: auto
    num_processes: int | None = None  # distributed: processes in all; None: auto (TPU, SLURM)
    process_id: int | None = None  # distributed: this process's index; None: auto
    heartbeat_timeout_s: float = 60.0  # distributed: a peer silent this long ends every process

    def __post_init__(self) -> None:
        _check_types(self)
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        _check(tp >= 1, f"tensor_parallel_size must be >= 1, got {tp}")
        _check(dp >= 1, f"data_parallel_size must be >= 1, got {dp}")
        if self.mesh_shape is not None:
            _check(
                len(self.mesh_shape) == 2 and all(n >= 1 for n in self.mesh_shape),
                f"mesh_shape must be two sizes >= 1, (data, tensor), got {list(self.mesh_shape)}",
            )
            mesh_dp, mesh_tp = self.mesh_shape
            _check(
                (dp in (1, mesh_dp)) and (tp in (1, mesh_tp)),
                f"mesh_shape={list(self.mesh_shape)} (data, tensor) contradicts "
                f"data_parallel_size={dp}, tensor_parallel_size={tp}",
            )
            object.__setattr__(self, "data_parallel_size", mesh_dp)
            object.__setattr__(self, "tensor_parallel_size", mesh_tp)
        _check(
            self.num_processes is None or self.num_processes >= 1,
            f"num_processes must be >= 1, got {self.num_processes}",
        )
        _check(
            self.process_id is None
            or (self.process_id >= 0 and (self.num_processes or 1 << 62) > self.process_id),
            f"process_id must be in [0, num_processes), got {self.process_id}",
        )
        _check(
            self.heartbeat_timeout_s > 0,
            f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative_decoding.md), spelled as vLLM's
    `speculative_config`: each step, a proposer guesses up to `num_speculative_tokens` next
    tokens of every decoding request and the step verifies them with the target model, at
    once, next to the other requests' tokens; the output is exactly what decoding one
    token at a time gives (token for token for greedy and seeded requests).

    method "ngram" (prompt lookup): the proposal is what followed the latest earlier
    occurrence of the request's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) in its prompt and output: no model, a gain where the output quotes
    its input. method "draft_model": a second, cheaper model drafts the proposal greedily,
    one token a step over its own KV pages: the checkpoint `model` (same tokenizer), or,
    without it, the target's own checkpoint, loaded with `quantization` (the int8 / 4-bit
    CPU path drafting for the float target). As in vLLM, giving `model` alone selects
    "draft_model". The engine turns the proposals down, step by step, when its measured step
    times (and the draft's) and the acceptance say they cost more than they bring."""

    SECTION: ClassVar[str] = "speculative_config"

    method: str = "none"  # speculative decoding: none | ngram (prompt lookup) | draft_model
    num_speculative_tokens: int = 4  # speculative decoding: tokens proposed per step at most
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched against earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched (tried first)
    model: str | None = None  # draft_model: its checkpoint (dir or file); None: the target's
    quantization: str | None = None  # draft_model: its weights (none | int8 | fp8); None: none

    def __post_init__(self) -> None:
        _check_types(self)
        if self.method == "none" and self.model is not None:  # (vLLM's spelling)
            object.__setattr__(self, "method", "draft_model")
        _check(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}",
        )
        _check(
            1 <= self.num_speculative_tokens <= 16,
            f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}",
        )
        _check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
            f"{self.prompt_lookup_min} and {self.prompt_lookup_max}",
        )
        _check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"speculative quantization must be one of {list(QUANTIZATIONS)}, "
            f"got {self.quantization!r}",
        )
        _check(
            self.method == "draft_model" or (self.model is None and self.quantization is None),
            f"speculative model and quantization are a draft_model's, not {self.method!r}'s",
        )
        _check(
            self.method != "draft_model" or self.model is not None or self.quantization,
            "a draft_model needs `model` (a draft checkpoint) or `quantization` (the target's "
            "own checkpoint in a cheaper form, e.g. int8)",
        )

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served on the base model (docs/lora.md), as vLLM's flags: requests name
    an adapter (`LLM.generate(lora_request=...)`, the server's `model` field) and run with
    it, adapters and base rows mixed in one step. The device holds `max_loras` adapters of
    rank up to `max_lora_rank` at once, in slot arrays of fixed shapes (nothing is
    recompiled when an adapter loads); more adapters wait on the host and take a slot when
    a request needs them."""

    SECTION: ClassVar[str] = "lora"

    enable_lora: bool = False  # serve LoRA adapters (slot arrays in the step)
    max_loras: int = 1  # adapters on the device at once (slots)
    max_lora_rank: int = 16  # the largest adapter rank a slot holds

    def __post_init__(self) -> None:
        _check_types(self)
        _check(1 <= self.max_loras <= 64, f"max_loras must be in [1, 64], got {self.max_loras}")
        _check(
            1 <= self.max_lora_rank <= 512,
            f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}",
        )
