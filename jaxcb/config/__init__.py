"""Engine configuration: frozen dataclasses, YAML loading and flat keyword overrides.

A YAML preset mirrors the dataclasses one to one::

    model: null              # model dir, .gguf file, hub id or built-in name; null = SmolLM2
    dtype: float32
    max_model_len: 512
    cache:     {page_size: 16, num_pages: 256, enable_prefix_caching: true}
    scheduler: {max_num_seqs: 8, max_num_batched_tokens: 64, scheduling_policy: fcfs}
    kernels:   {attention: auto, matmul: auto}
    limits:    {max_waiting_requests: 1024, max_n: 128}
    parallel:  {tensor_parallel_size: 1, data_parallel_size: 1}
    speculative_config: {method: ngram, num_speculative_tokens: 4}   # as vLLM's
    lora:      {enable_lora: true, max_loras: 4, max_lora_rank: 16}

Every field, however nested, can also be given flat (`LLM(page_size=16)`,
`serve.py --page-size 16`): field names are unique across sections. Unknown names and bad
values raise ValueError naming the offender and the valid choices.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from jaxcb.config.sections import (
    ADMISSION_MODES,
    ATTENTION_BACKENDS,
    BATCHING_MODES,
    DTYPES,
    MATMUL_BACKENDS,
    QUANTIZATIONS,
    CacheConfig,
    KernelConfig,
    LimitsConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jaxcb.config.values import check as _check
from jaxcb.config.values import check_types as _check_types
from jaxcb.config.values import coerce as _coerce
from jaxcb.config.values import to_plain as _to_plain

__all__ = [
    "ADMISSION_MODES",
    "ATTENTION_BACKENDS",
    "BATCHING_MODES",
    "DTYPES",
    "MATMUL_BACKENDS",
    "QUANTIZATIONS",
    "SECTIONS",
    "CacheConfig",
    "EngineConfig",
    "KernelConfig",
    "LimitsConfig",
    "LoraConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "field_type",
    "flat_fields",
]


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; `EngineConfig.from_yaml(path, **flat_overrides)`."""

    model: str | None = None  # HF dir, .gguf file, hub id or built-in name; None: SmolLM2
    tokenizer: str | None = None  # tokenizer directory; None = the model directory
    dtype: str = "float32"  # weights, activations and KV pages
    quantization: str = "none"  # none | int8 (groups of 32) | fp8 (e4m3, per output channel)
    max_model_len: int | None = None  # prompt + output tokens; None = model's max positions
    seed: int = 0  # seeds requests that bring no seed of their own
    # Persistent XLA compilation cache: "auto" (a dir under the jaxcb cache), "off", or a path.
    compilation_cache: str = "auto"  # auto | off | a directory
    # Compile only the smallest bucket before the engine is ready and the others on a
    # background thread while it runs (a step whose program is not compiled yet waits for
    # it). None: on in the server (it answers sooner), off for offline jobs.
    compile_in_background: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.dtype in DTYPES, f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        _check(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )
        if self.lora.enable_lora:
            _check(
                self.scheduler.batching == "continuous",
                "enable_lora needs batching continuous (the padded-batch baselines serve the "
                "base model only)",
            )
            _check(
                self.kernels.scan_layers is not False,
                "enable_lora needs kernels.scan_layers true (the adapters' slot arrays are "
                "read per layer of the scan)",
            )

    @property
    def max_num_sample_rows(self) -> int:
        """Sampling rows of the largest step (the buckets' S at most): one per sequence,
        and with speculative decoding one more per token it may propose for each."""
        spec = self.speculative_config
        per_seq = 1 + (spec.num_speculative_tokens if spec.enabled else 0)
        return self.scheduler.max_num_seqs * per_seq

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

SECTIONS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "kernels": KernelConfig,
    "limits": LimitsConfig,
    "parallel": ParallelConfig,
    "speculative_config": SpeculativeConfig,
    "lora": LoraConfig,
}


def flat_fields() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """Every settable field by flat name → (section or None, dataclass field). A section's
    field named as a top-level one (speculative_config's `model` and `quantization`, as
    vLLM spells them) is set through its section only."""
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    top = {f.name for f in fields(EngineConfig)}
    for f in fields(EngineConfig):
        if f.name in SECTIONS:
            for sub in fields(SECTIONS[f.name]):
                if sub.name not in top:
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
        if name in SECTIONS:
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
        if key in SECTIONS:
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
        if key in SECTIONS and cls is EngineConfig:
            kwargs[key] = _build(SECTIONS[key], value, path=f"{key}.")
        else:
            kwargs[key] = _coerce(value, hints[key], f"{path}{key}")
    return cls(**kwargs)
