"""Engine configuration: frozen dataclasses, YAML loading and flat keyword overrides.

A YAML preset mirrors the dataclasses one to one::

    model: null              # Hugging Face model dir; null = built-in tiny random model
    dtype: float32
    max_model_len: 512
    cache:     {page_size: 16, num_pages: 256, enable_prefix_caching: true}
    scheduler: {max_num_seqs: 8, max_num_batched_tokens: 64, scheduling_policy: fcfs}
    kernels:   {attention: auto, matmul: auto}
    limits:    {max_waiting_requests: 1024, max_n: 128}
    parallel:  {tensor_parallel_size: 1, data_parallel_size: 1}

Every field, however nested, can also be given flat (`LLM(page_size=16)`,
`serve.py --page-size 16`): field names are unique across sections. Unknown names and bad
values raise ValueError naming the offender and the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "native", "xla", "pallas", "pallas-tpu", "pallas-gpu")
MATMUL_BACKENDS = ("auto", "amx", "avx512_bf16", "avx512", "xla")
SCHEDULING_POLICIES = ("fcfs", "priority", "srpf")
BATCHING_MODES = ("continuous", "static", "dynamic")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_types(config: Any) -> None:
    """Type-check (and gently convert) every field, so that direct construction
    (`CacheConfig(page_size="8")`) fails with the same ValueError as YAML and flags do,
    never with a TypeError from a comparison further down."""
    cls = type(config)
    prefix = next((f"{name}." for name, c in _SECTIONS.items() if c is cls), "")
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        value = getattr(config, f.name)
        if cls is EngineConfig and f.name in _SECTIONS:
            section = _SECTIONS[f.name]
            _check(
                isinstance(value, section),
                f"{f.name} must be a {section.__name__} (or build the config with "
                f"EngineConfig.from_dict), got {value!r}",
            )
        else:
            object.__setattr__(config, f.name, _coerce(value, hints[f.name], prefix + f.name))


@dataclass(frozen=True)
class CacheConfig:
    """KV page pool. Size it with `num_pages`, or `kv_cache_memory_gb`, or neither (auto)."""

    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # pages in the pool (per layer)
    kv_cache_memory_gb: float | None = None  # K+V bytes for all layers, in GiB
    memory_utilization: float = 0.9  # share of free accelerator memory auto sizing may use
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16; auto: model dtype, f32 on CPU
    enable_prefix_caching: bool = True  # share cached full pages of common prompt prefixes

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
            self.kv_cache_dtype in ("auto", *DTYPES),
            f"kv_cache_dtype must be one of {['auto', *DTYPES]}, got {self.kv_cache_dtype!r}",
        )
        _check(
            0 < self.memory_utilization <= 1,
            f"memory_utilization must be in (0, 1], got {self.memory_utilization}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling under a token budget."""

    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 512  # tokens per step at most (the largest bucket)
    # Precompiled token buckets; None = powers of two from 16 up to max_num_batched_tokens.
    token_buckets: tuple[int, ...] | None = None
    # Sequence-row sizes compiled for each token bucket besides min(T, max_num_seqs): a step
    # with few sequences (a lone prompt's prefill) then runs the lm_head and sampling on few
    # rows, not on max_num_seqs padded ones. Each extra size adds a compile per token bucket.
    seq_buckets: tuple[int, ...] = (16,)
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower value first) | srpf
    srpf_aging: float = 16.0  # srpf: tokens a waiting request gains on newer ones per step
    long_prefill_token_threshold: int = 0  # prefill tokens per request per step; 0: no cap
    watermark: float = 0.01  # pages admission leaves free: a fraction (< 1) or a count
    batching: str = "continuous"  # continuous | static | dynamic (padded-batch baselines)

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, "
            f"got {self.scheduling_policy!r}",
        )
        _check(
            self.batching in BATCHING_MODES,
            f"batching must be one of {list(BATCHING_MODES)}, got {self.batching!r}",
        )
        _check(self.srpf_aging > 0, f"srpf_aging must be > 0, got {self.srpf_aging}")
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
    products, for CPUs without AMX), "avx512" (float32 weights, AVX-512 FMAs), "xla", or
    "auto" (the first native kernel that can run, else xla).

    greedy_screen: with "avx512" on a CPU that also has AVX512-BF16, steps whose rows are all
    greedy (no sampling, penalties or logprobs) find each row's token with a bf16 LM head
    and recompute in float32 only the few columns that could hold its maximum: the same
    tokens as the float32 LM head at about half its cost (a bf16 copy of lm_head in memory)."""

    attention: str = "auto"  # auto | native | xla | pallas | pallas-tpu | pallas-gpu
    matmul: str = "auto"  # auto | amx | avx512_bf16 | avx512 | xla
    greedy_screen: bool = True

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
    first, for multi-host meshes."""

    tensor_parallel_size: int = 1  # devices one engine is sharded over (heads, MLP, vocab)
    data_parallel_size: int = 1  # independent engine replicas, each on its own devices
    mesh_shape: tuple[int, ...] | None = None  # (data, tensor) sizes; same as the two above
    distributed: bool = False  # multi-host: call jax.distributed.initialize() first
    coordinator_address: str | None = None  # distributed: process 0's host:port; None: auto
    num_processes: int | None = None  # distributed: processes in all; None: auto (TPU, SLURM)
    process_id: int | None = None  # distributed: this process's index; None: auto

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


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; `EngineConfig.from_yaml(path, **flat_overrides)`."""

    model: str | None = None  # Hugging Face model directory; None = built-in tiny model
    tokenizer: str | None = None  # tokenizer directory; None = the model directory
    dtype: str = "float32"  # weights, activations and KV pages
    max_model_len: int | None = None  # prompt + output tokens; None = model's max positions
    seed: int = 0  # seeds requests that bring no seed of their own
    # Persistent XLA compilation cache: "auto" (a dir under the jaxcb cache), "off", or a path.
    compilation_cache: str = "auto"  # auto | off | a directory
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.dtype in DTYPES, f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None = None, **flat: Any) -> EngineConfig:
        """Build from a nested mapping (YAML layout) plus flat keyword overrides."""
        if data is not None and not isinstance(data, Mapping):
            raise ValueError(f"config must be a mapping, got {type(data).__name__}: {data!r}")
        nested = _nest(dict(data or {}), source="config")
        for key, value in _nest_flat(flat).items():
            if isinstance(value, dict):
                nested.setdefault(key, {}).update(value)
            else:
                nested[key] = value
        return _build(cls, nested, path="")

    @classmethod
    def from_yaml(cls, path: str | Path, **flat: Any) -> EngineConfig:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
        return cls.from_dict(data, **flat)

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with flat overrides applied."""
        return EngineConfig.from_dict(self.to_dict(), **flat)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))


# ---- helpers ----------------------------------------------------------------------------

_SECTIONS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "kernels": KernelConfig,
    "limits": LimitsConfig,
    "parallel": ParallelConfig,
}


def flat_fields() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """Every settable field by flat name → (section or None, dataclass field)."""
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for f in fields(EngineConfig):
        if f.name in _SECTIONS:
            for sub in fields(_SECTIONS[f.name]):
                out[sub.name] = (f.name, sub)
        else:
            out[f.name] = (None, f)
    return out


def field_type(f: dataclasses.Field, owner: type) -> Any:
    return typing.get_type_hints(owner)[f.name]


def _nest_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
    known = flat_fields()
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        if name in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ValueError(f"{name!r} must be a mapping of its fields, got {value!r}")
            nested.setdefault(name, {}).update(value)
            continue
        if name not in known:
            raise ValueError(f"unknown config field {name!r}; valid fields: {sorted(known)}")
        section, _ = known[name]
        if section is None:
            nested[name] = value
        else:
            nested.setdefault(section, {})[name] = value
    return nested


def _nest(data: dict[str, Any], source: str) -> dict[str, Any]:
    top = {f.name for f in fields(EngineConfig)}
    for key, value in data.items():
        if key not in top:
            raise ValueError(f"unknown key {key!r} in {source}; valid keys: {sorted(top)}")
        if key in _SECTIONS:
            if value is None:
                data[key] = {}
            elif not isinstance(value, Mapping):
                raise ValueError(f"{key!r} in {source} must be a mapping, got {value!r}")
            else:
                data[key] = dict(value)
    return data


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    valid = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            where = path.rstrip(".") or "config"
            raise ValueError(f"unknown key {key!r} in {where}; valid keys: {sorted(valid)}")
        if key in _SECTIONS and cls is EngineConfig:
            kwargs[key] = _build(_SECTIONS[key], value, path=f"{key}.")
        else:
            kwargs[key] = _coerce(value, hints[key], f"{path}{key}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Check (and gently convert) a value against a field's type hint."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return tuple(_coerce(v, args[0], name) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, os.PathLike):  # model / tokenizer directories
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    return value


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_to_plain(v) for v in value]
    return value
