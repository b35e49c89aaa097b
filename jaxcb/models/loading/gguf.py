"""GGUF files (llama.cpp's format): metadata, and tensors dequantized to float32.

The header is parsed by gguf_header.py (fast: a vocabulary of 49k tokens in ~0.1 s); tensors
are dequantized by the `gguf` package, ggml's own dequantizers, so every tensor type it
can dequantize loads: F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K-quants and the IQ types.
Dequantized, a GGUF matrix is [out, in] as in a Hugging Face checkpoint, so a family names
llama.cpp's tensors by its Hugging Face names (its GGUF_TENSORS), and its params_from_hf does
the rest through `GGUFTensors`; what a family makes of the metadata (its config_from_gguf)
lives in the family's file. This module knows only the format. Every failure is a one-line
ModelLoadError naming the file and the problem.
"""

from __future__ import annotations

import importlib.metadata
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxcb.models.loading.gguf_header import read_header
from jaxcb.models.weights import CheckpointTensors, ModelLoadError

MAGIC = b"GGUF"
#: Metadata keys naming a token that ends a turn (besides tokenizer.ggml.eos_token_id).
STOP_TOKEN_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",  # end of turn
    "tokenizer.ggml.eom_token_id",  # end of message (Llama 3.1's tool calls)
)
#: The block types whose values are d x code + m with a float16 scale d and offset m per
#: block of 32 (the layout of `quant.quantize_int8`'s groups): type -> the code's offset,
#: m = -offset x d (Q8_0: d x q8 with q8 an int8, the code q8 + 128; Q4_0: d x (q4 - 8), the
#: code q4), or None where the block stores m after d (Q4_1: d x q4 + m).
BLOCK_OFFSETS = {
    gguf.GGMLQuantizationType.Q8_0: 128,
    gguf.GGMLQuantizationType.Q4_0: 8,
    gguf.GGMLQuantizationType.Q4_1: None,
}
# What a failing reader throws on a truncated or corrupt file: numpy's errors from reading
# past the end of its memory map, struct-like decoding errors, unknown enum values.
_READER_ERRORS = (
    ValueError,
    IndexError,
    KeyError,
    OverflowError,
    UnicodeDecodeError,
    EOFError,
    struct.error,
)


def is_gguf_path(path: str | Path) -> bool:
    """Whether a model path is meant as a GGUF file: it ends in .gguf or is a file (Hugging
    Face and jaxcb checkpoints are directories). GGUFFile says so if it is not one."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" or path.is_file()


class GGUFMetadata(dict[str, Any]):
    """A GGUF file's metadata as plain Python values; `require` names the file on a miss."""

    def __init__(self, values: Mapping[str, Any], path: Path) -> None:
        super().__init__(values)
        self.path = path

    def require(self, key: str) -> Any:
        if self.get(key) is None:
            raise ModelLoadError(f"{self.path} lacks GGUF metadata key {key!r}")
        return self[key]


class GGUFFile:
    """A GGUF file opened for reading: metadata, tensor shapes, dequantized tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file not found: {self.path}")
        with self.path.open("rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ModelLoadError(
                    f"{self.path} is not a GGUF file: it does not start with the GGUF magic bytes"
                )
        try:
            values, tensors = read_header(self.path)
        except _READER_ERRORS as exc:
            size = self.path.stat().st_size
            detail = " ".join(str(exc).split())[:200]
            raise ModelLoadError(
                f"{self.path} ({size} bytes) is truncated or corrupt, or newer than the gguf "
                f"{_gguf_version()} package reads: {type(exc).__name__}: {detail}"
            ) from None
        self.metadata = GGUFMetadata(values, self.path)
        self._tensors = {t.name: t for t in tensors}
        self.shapes = {t.name: t.shape for t in tensors}  # numpy order
        splits = self.metadata.get("split.count", 1)
        if splits > 1:
            raise ModelLoadError(
                f"{self.path} is one of {splits} split GGUF files; merge them into one first "
                "(llama-gguf-split --merge)"
            )
        self._check_types()

    def _check_types(self) -> None:
        """Every tensor type must be one gguf can dequantize: found before any is read."""
        first = {}
        for tensor in self._tensors.values():
            first.setdefault(tensor.tensor_type, tensor.name)
        for qtype, name in first.items():
            block = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
            try:
                gguf.quants.dequantize(block, qtype)
            except NotImplementedError:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} is stored as {qtype.name}, which the gguf "
                    f"{_gguf_version()} package cannot dequantize"
                ) from None

    @property
    def architecture(self) -> str:
        return self.metadata.require("general.architecture")

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor `name` as float32, in numpy order."""
        tensor = self._tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(self.shapes[name])

    def block_grid(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(d, m), float32 arrays of the tensor's shape (numpy order): each element's block
        scale and offset, the values being d x code + m with integer codes (what
        `dequantize` gives, exactly), for a tensor stored as Q8_0, Q4_0 or Q4_1 (BLOCK_OFFSETS);
        None for any other type. Read from the blocks' own bytes: f16 d first, then Q4_1's
        f16 m."""
        tensor = self._tensors[name]
        if tensor.tensor_type not in BLOCK_OFFSETS:
            return None
        offset = BLOCK_OFFSETS[tensor.tensor_type]
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(-1, type_size)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
        m = -offset * d if offset is not None else blocks[:, 2:4].copy().view(np.float16)
        shape = self.shapes[name]
        d, m = (np.repeat(x.astype(np.float32), block_size, axis=1).reshape(shape) for x in (d, m))
        return d, m

    def stored_dtype(self) -> str:
        """ "bfloat16" if every matrix is stored in bfloat16, else "float32" (what quantized,
        float16 and float32 tensors dequantize to without loss)."""
        matrices = [t.tensor_type for t in self._tensors.values() if len(t.dims) > 1]
        bf16 = gguf.GGMLQuantizationType.BF16
        return "bfloat16" if matrices and all(t == bf16 for t in matrices) else "float32"

    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids of the tokens the metadata says end a turn (EOS, end of turn, end of
        message)."""
        return tuple(sorted({int(self.metadata[k]) for k in STOP_TOKEN_KEYS if k in self.metadata}))

    def tensors(
        self,
        names: Mapping[str, str | tuple[str, ...]],
        num_layers: int,
        transform: Callable[[str, np.ndarray], np.ndarray],
        values: Callable[[str], np.ndarray] | None = None,
    ) -> GGUFTensors:
        """The file's tensors under a family's Hugging Face names, for its params_from_hf.

        `names`: GGUF name -> Hugging Face name, "{n}" standing for the layer index, or a
        tuple of names where a family's variants call one llama.cpp tensor differently
        (moe.py: Mixtral's `block_sparse_moe.gate` is Qwen-MoE's `mlp.gate`; each variant
        takes the one it knows); `transform(hf_name, array)`: what the family undoes of
        llama.cpp's layout; `values(gguf_name)`: the array a tensor stands for, float32 in
        numpy order (default: `dequantize`; the loader's block grids take each element's
        block scale instead)."""
        hf_to_gguf = {}
        for gguf_name, hf_names in names.items():
            layers = range(num_layers) if "{n}" in gguf_name else [0]
            for hf_name in (hf_names,) if isinstance(hf_names, str) else hf_names:
                for n in layers:
                    hf_to_gguf[hf_name.format(n=n)] = gguf_name.format(n=n)
        return GGUFTensors(self, hf_to_gguf, transform, values or self.dequantize)


class GGUFTensors(CheckpointTensors):
    """`take(hf_name, shape)` finds the GGUF tensor, checks its shape against the one the
    metadata implies, dequantizes it (or whatever `values` gives) and applies the family's
    transform; the GGUF tensors nobody took are reported once (warn_unused)."""

    def __init__(
        self,
        file: GGUFFile,
        hf_to_gguf: dict[str, str],
        transform: Callable[[str, np.ndarray], np.ndarray],
        values: Callable[[str], np.ndarray] | None = None,
    ) -> None:
        super().__init__(file.shapes, file.path)
        self.file = file
        self.hf_to_gguf = hf_to_gguf
        self.transform = transform
        self.values = values or file.dequantize

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        gguf_name = self.hf_to_gguf.get(name, name)
        if gguf_name not in self.file.shapes:
            raise ModelLoadError(f"{self.source} lacks tensor {gguf_name!r}")
        have = self.file.shapes[gguf_name]
        if have != shape:
            raise ModelLoadError(
                f"tensor {gguf_name!r} in {self.source} has shape {have}, expected {shape} "
                "from the GGUF metadata"
            )
        self.used.add(gguf_name)
        return self.transform(name, self.values(gguf_name))

    def skip(self, name: str) -> None:
        self.used.add(self.hf_to_gguf.get(name, name))

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.file.shapes.get(self.hf_to_gguf.get(name, name))


def _gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        return "(unknown version)"
