"""Hugging Face checkpoint files: config.json with typed field reads, and safetensors tensors.

Single-file checkpoints and sharded ones (`model.safetensors.index.json`), stored in float32,
float16 or bfloat16, are memory-mapped, not read. What a family makes of them (its weight
names, its config mapping) lives in the family's file; this module knows only the formats.
Every failure is a ModelLoadError naming the file, the field or the tensor at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model cannot be loaded (missing file, unsupported model, bad field or tensor)."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc


_REQUIRED = object()


class ConfigFields:
    """Typed reads of a config mapping: a missing field, or one of the wrong type, is a
    ModelLoadError naming the file and the field ("config.json: hidden_size must be an
    integer, got 'big'"), not a bare int() error."""

    def __init__(self, cfg: Mapping[str, Any], source: str = "config.json") -> None:
        self.cfg = cfg
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.cfg.get(key)
        return default if value is None else value

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        value = self._value(key, default)
        if value is None:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._wrong(key, "an integer", value)
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._value(key, default)
        if value is None:
            return value
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self._wrong(key, "a number", value)
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._value(key, default)
        if value is None:
            return value
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false", value)
        return value

    def _value(self, key: str, default: Any) -> Any:
        """The field's value; a missing (or null) field is `default`, or an error."""
        value = self.cfg.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.source} lacks required field {key!r}")
            return default
        return value

    def _wrong(self, key: str, kind: str, value: Any) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {key} must be {kind}, got {value!r}")


def generation_eos(model_dir: Path) -> set[int]:
    """The EOS ids of the directory's generation_config.json (none without one)."""
    gen_path = model_dir / "generation_config.json"
    if not gen_path.is_file():
        return set()
    try:
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{gen_path} is not valid JSON: {exc}") from exc
    return set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc}") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir} (PyTorch .bin checkpoints are not "
            "supported; re-save with save_pretrained(safe_serialization=True))"
        )
    return files


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors_file(path: Path) -> dict[str, np.ndarray]:
    """Memory-map one .safetensors file: an 8-byte header length, a JSON header, raw data.

    Reading it with numpy directly keeps tensors on the host (no trip through a device) and
    handles bfloat16, which safetensors' own numpy reader rejects.
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.size < 8:
        raise ModelLoadError(f"{path} is too short to be a safetensors file")
    header_len = int(raw[:8].view("<u8")[0])
    if header_len <= 0 or 8 + header_len > raw.size:
        raise ModelLoadError(f"{path} has a corrupt safetensors header")
    try:
        header = json.loads(bytes(raw[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} has a corrupt safetensors header: {exc}") from exc
    data = raw[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r} in {path}"
        try:
            dtype_name, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(d) for d in shape)
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{where} has a corrupt header entry: {info!r:.200}") from None
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise ModelLoadError(f"{where} has unsupported dtype {dtype_name}")
        # Offsets against the file's size: a truncated download fails here, by name, and not
        # as a reshape error (or a read past the end of the memory map).
        if not 0 <= start <= end <= data.size:
            raise ModelLoadError(
                f"{where} lies at bytes [{start}, {end}) of the data, but the file has only "
                f"{data.size} bytes of data: it is truncated or corrupt"
            )
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - start != need:
            raise ModelLoadError(
                f"{where} has {end - start} bytes, but shape {list(shape)} of {dtype_name} "
                f"needs {need}: the file is corrupt"
            )
        out[name] = data[start:end].view(dtype).reshape(shape)
    return out


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint as (memory-mapped) numpy arrays."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(Path(model_dir)):
        tensors.update(read_safetensors_file(path))
    return tensors


class CheckpointTensors:
    """A checkpoint's tensors by name, for a family's `params_from_hf`: `take` checks each
    tensor's shape against the config, and the tensors nobody took are reported once."""

    def __init__(self, tensors: Mapping[str, np.ndarray], source: str | Path) -> None:
        self.tensors = tensors
        self.source = source
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ModelLoadError(f"checkpoint in {self.source} lacks tensor {name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} in {self.source} has shape {tuple(t.shape)}, expected "
                f"{shape} from config.json"
            )
        self.used.add(name)
        return t

    def skip(self, name: str) -> None:
        """A tensor the family knows and does not need (a tied lm_head's copy, say)."""
        self.used.add(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape, None if the checkpoint lacks it: for a family that reads one
        of two layouts (moe.py: per-expert matrices, or GGUF's stacks of them)."""
        return tuple(self.tensors[name].shape) if name in self.tensors else None

    def warn_unused(self) -> None:
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            logger.warning("ignoring %d checkpoint tensors, e.g. %s", len(unused), unused[:3])


def cast(x: np.ndarray, dtype: Any) -> np.ndarray:
    """A checkpoint tensor (any float dtype, memory-mapped) as a host array of `dtype`."""
    return np.asarray(x, dtype=np.float32).astype(dtype)
