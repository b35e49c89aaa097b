"""A GGUF file's header parsed straight from its bytes: the metadata and the tensor table.

The `gguf` package's reader builds a numpy view per field part, which costs ~35 us a part:
a 49,152-token vocabulary (tokens, scores, types, ~48k merges) took 3.4 s to open on a Zen 5
core, paid once by the model loader and once more by the server's own tokenizer. Here the
format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3, either
byte order) is walked with `struct` over a memory map, and numeric arrays are taken whole
with `np.frombuffer`: the same file opens in ~0.1 s. Tensor data stays in the memory map
until a tensor is dequantized (by the `gguf` package's dequantizers, gguf.py).

Errors (truncated or corrupt files) are the standard ones (struct.error, ValueError,
UnicodeDecodeError, IndexError); gguf.py turns them into one-line ModelLoadErrors.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

#: GGUF metadata value types -> struct format (scalars) or the numpy dtype of an array of them
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
#: tensor types stored as plain numbers (the rest are blocks, read as bytes)
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]  # ggml order: fastest-moving first
    data: (
        np.ndarray
    )  # plain types: the values, numpy order; block types: the bytes [rows, row bytes]

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order"""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, buffer: Any, byte_order: str) -> None:
        self.buffer, self.order, self.pos = buffer, byte_order, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.pos + n
        if end > len(self.buffer):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self.buffer[self.pos : end]).decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"unknown GGUF value type {kind}")

    def array(self) -> list[Any]:
        kind, count = self.scalar("I"), self.scalar("Q")
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind]).newbyteorder(self.order)
            end = self.pos + count * dtype.itemsize
            if end > len(self.buffer):
                raise ValueError(f"an array of {count} values runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        return [self.value(kind) for _ in range(count)]


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata as plain Python values, the tensors with their data memory-mapped)."""
    with path.open("rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (version,) = struct.unpack_from("<I", buffer, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written big-endian
        order, version = ">", struct.unpack_from(">I", buffer, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (versions 2 and 3 are read)")
    cursor = _Cursor(buffer, order)
    cursor.pos = 8
    num_tensors, num_values = cursor.scalar("Q"), cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_values):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
    table = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        table.append((name, GGMLQuantizationType(cursor.scalar("I")), dims, cursor.scalar("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    everything = np.frombuffer(buffer, np.uint8)
    tensors, names = [], set()
    for name, kind, dims, offset in table:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(
            TensorInfo(
                name, kind, dims, _tensor_data(everything, start + offset, kind, dims, order)
            )
        )
    return metadata, tensors


def _tensor_data(
    everything: np.ndarray,
    offset: int,
    kind: GGMLQuantizationType,
    dims: tuple[int, ...],
    order: str,
) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    num_elements = int(np.prod(dims, dtype=np.int64))
    num_bytes = num_elements * type_size // block_size
    if offset + num_bytes > everything.size:
        raise ValueError(f"tensor data at {offset} (+{num_bytes} bytes) is past the file's end")
    data = everything[offset : offset + num_bytes]
    shape = tuple(reversed(dims))
    if kind in _PLAIN:
        return data.view(np.dtype(_PLAIN[kind]).newbyteorder(order)).reshape(shape)
    # blocks: each row of the innermost dimension is its own whole blocks
    return data.reshape(*shape[:-1], shape[-1] // block_size * type_size)
