"""Resolve a model (a path, a built-in name, a hub id, or None: the default) into spec,
params, tokenizer and EOS ids.

A model path is a Hugging Face directory (config.json + safetensors), a jaxcb orbax
checkpoint (scripts/convert_checkpoint.py; loading/checkpoint.py), both holding config.json,
or a GGUF file (loading/gguf.py), whose metadata holds the config, tokenizer and chat template.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from jaxcb.models import registry
from jaxcb.models.base import ModelSpec, Params, is_param_info
from jaxcb.models.loading.checkpoint import (
    checkpoint_quantization,
    is_orbax_checkpoint,
    restore_params,
)
from jaxcb.models.loading.default_model import NAME as TINY_NAME
from jaxcb.models.loading.default_model import SMOLLM2_NAME, builtin_model
from jaxcb.models.loading.gguf import BLOCK_OFFSETS, GGUFFile, is_gguf_path
from jaxcb.models.loading.gguf_tokenizer import gguf_tokenizer
from jaxcb.models.loading.hub import download, looks_like_hub_id
from jaxcb.models.registry import spec_from_gguf, spec_from_hf_config
from jaxcb.models.weights import (
    CheckpointTensors,
    ModelLoadError,
    cast,
    generation_eos,
    read_hf_config,
    read_safetensors,
)

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: Path
    spec: ModelSpec
    params: Params  # numpy arrays in host memory (HF), or jax arrays already sharded (orbax)
    tokenizer: Any | None  # transformers tokenizer, or None if the directory has none
    eos_token_ids: tuple[int, ...]
    random_weights: bool  # the built-in tiny random-weight model: its text is noise
    format: str = "safetensors"  # "safetensors" (Hugging Face), "orbax" or "gguf"
    #: {"layers": [{name: (d, m)}]}: the layer matmul weights a GGUF file stores in blocks
    #: (load_gguf_block_grids), for quantize_params to hold exactly; loaded for int8 only
    block_grids: Params | None = None
    #: "int8": the params are quantized already (a jaxcb checkpoint stored so)
    quantization: str = "none"


def resolve_model(model: str | Path | None) -> tuple[Path, bool]:
    """(local path, random weights) of what `model` names: None (the default,
    SmolLM2-135M-Instruct) or a built-in name (default_model.py), a directory or .gguf file
    on this machine, or a Hugging Face hub id ("org/name", through the hub cache)."""
    builtin = builtin_model(None if model is None else str(model))
    if builtin is not None:
        path, random_weights = builtin
        if random_weights:
            logger.warning(
                "using the built-in tiny Llama at %s: its weights are RANDOM, so its text is "
                "noise (fast tests); the real default is %s",
                path,
                SMOLLM2_NAME,
            )
        return path, random_weights
    if looks_like_hub_id(str(model)):
        return download(str(model)), False
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model not found: {model} is no directory or .gguf file here, no built-in name "
            f"({SMOLLM2_NAME}, {TINY_NAME}) and no Hugging Face hub id (org/name)"
        )
    return path, False


def load_model(
    model: str | Path | None,
    *,
    tokenizer_path: str | Path | None,
    dtype: Any,
    shardings: Callable[[ModelSpec], Any] | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """`shardings(spec)`: the params' target shardings. An orbax checkpoint is restored
    straight into them; safetensors and GGUF tensors (dequantized) are read into host memory
    (the runner places them). It is called before any weight is read, so a model that cannot
    be sharded fails fast. `quantization`: what the params will be quantized to
    (quant.quantize_params); for "int8", a GGUF file's block-quantized layer matmul weights
    come with their block grids (LoadedModel.block_grids) and stay float32 for exactness."""
    path, random_weights = resolve_model(model)
    if is_gguf_path(path):
        return _load_gguf(path, tokenizer_path, dtype, shardings, random_weights, quantization)
    spec = spec_from_hf_config(read_hf_config(path))
    target = shardings(spec) if shardings is not None else None
    fmt = "orbax" if is_orbax_checkpoint(path) else "safetensors"
    stored = "none"
    if fmt == "orbax":
        params = restore_params(path, spec, dtype, target)
        stored = checkpoint_quantization(path)
    else:
        params = load_params(path, spec, dtype)
    tokenizer = load_tokenizer(Path(tokenizer_path) if tokenizer_path else path)
    eos = _eos_ids(spec, generation_eos(path), tokenizer)
    return LoadedModel(path, spec, params, tokenizer, eos, random_weights, fmt, quantization=stored)


def _load_gguf(
    path: Path,
    tokenizer_path: str | Path | None,
    dtype: Any,
    shardings: Callable[[ModelSpec], Any] | None,
    random_weights: bool,
    quantization: str = "none",
) -> LoadedModel:
    """A GGUF file: config, tokenizer and stop tokens from its metadata, its tensors
    dequantized to `dtype` in host memory (the runner places them). For int8, the layer
    matmul weights stored in blocks come with their block grids and stay float32 (their
    values exactly, for quantize_params to recover the blocks' codes; it quantizes them
    right after, so they never reach the devices as float32)."""
    file = GGUFFile(path)
    _, spec = spec_from_gguf(file)
    if shardings is not None:
        shardings(spec)  # fails fast if the model cannot be sharded
    params, grids = load_gguf_for(file, spec, dtype, quantization)
    tokenizer = load_tokenizer(Path(tokenizer_path)) if tokenizer_path else gguf_tokenizer(file)
    eos = _eos_ids(spec, set(file.stop_token_ids()), tokenizer)
    return LoadedModel(path, spec, params, tokenizer, eos, random_weights, "gguf", grids)


def _eos_ids(spec: ModelSpec, more: set[int], tokenizer: Any | None) -> tuple[int, ...]:
    """The config's EOS ids, `more` (a generation config's, a GGUF file's stop tokens), and
    the tokenizer's EOS."""
    eos = set(spec.eos_token_ids) | more
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return tuple(sorted(eos))


def load_params(model_dir: str | Path, spec: ModelSpec, dtype: Any) -> Params:
    """Read, check, fuse and cast a Hugging Face checkpoint's tensors into the params pytree
    of `spec`'s family (host numpy arrays)."""
    tensors = CheckpointTensors(read_safetensors(model_dir), model_dir)
    params = registry.family(spec).params_from_hf(tensors, spec, dtype)
    tensors.warn_unused()
    return params


def load_gguf_params(file: GGUFFile, spec: ModelSpec, dtype: Any) -> Params:
    """Dequantize, check and rearrange a GGUF file's tensors into the params pytree of
    `spec`'s family (host numpy arrays of `dtype`), through its Hugging Face names."""
    family = registry.family(spec)
    transform = partial(family.tensor_from_gguf, spec=spec, arch=file.architecture)
    tensors = file.tensors(family.GGUF_TENSORS, spec.num_layers, transform)
    params = family.params_from_hf(tensors, spec, dtype)
    tensors.warn_unused()
    return params


def load_gguf_for(
    file: GGUFFile, spec: ModelSpec, dtype: Any, quantization: str
) -> tuple[Params, Params | None]:
    """(params, block grids) of a GGUF file about to be quantized as `quantization` says:
    for "int8", the layer matmul weights stored in blocks stay float32 (their values
    exactly, for quant.quantize_params to recover the blocks' codes) and come with their
    grids; else (or with no block-quantized tensor) every tensor in `dtype`, no grids."""
    grids = load_gguf_block_grids(file, spec) if quantization == "int8" else None
    if grids is None:
        return load_gguf_params(file, spec, dtype), None
    return _cast_all_but_grids(load_gguf_params(file, spec, np.float32), grids, dtype), grids


#: The dtype of the block grids' arrays: d and m are float16 in the blocks, so exact (a
#: Q8_0 offset -128 d past float16's range becomes inf and that weight is quantized anew).
GRID_DTYPE = np.float16


#: The GGUF tensors of the output head: its own, or the embedding table it is tied to.
HEAD_TENSORS = ("output.weight", "token_embd.weight")


def load_gguf_block_grids(file: GGUFFile, spec: ModelSpec) -> Params | None:
    """{"layers": [{name: (d, m)}], "lm_head": (d, m)}: for each layer matmul weight
    (ParamInfo.matmul) whose GGUF tensors are all stored as Q8_0, Q4_0 or Q4_1, each
    element's block scale d and offset m (GGUFFile.block_grid) in the params' layout, for
    quant.quantize_int8's `grid`; the same for the output head ([H, V]: its own tensor, or
    the embedding table it is tied to, transposed) when stored so; None if no layer tensor
    is stored so.

    The family's own params_from_hf puts them there: run twice more (d, then m) through
    GGUFTensors that give each tensor's block grid instead of its values, after the same
    transform (the families only permute and reshape their matmul weights, so each element
    keeps its block's d and m). Tensors of other types give NaN, which marks the weights
    built from them (left out). Peak host memory: the two grids' float16 arrays besides
    the float32 params."""
    block_types = {t.name for t in BLOCK_OFFSETS}
    if not any(n.startswith("blk.") and file.type_name(n) in block_types for n in file.shapes):
        return None
    family = registry.family(spec)
    transform = partial(family.tensor_from_gguf, spec=spec, arch=file.architecture)
    infos = registry.param_infos(spec)["layers"]

    def part(i: int) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
        def values(name: str) -> np.ndarray:
            wanted = name.startswith("blk.") or name in HEAD_TENSORS
            grid = file.block_grid(name) if wanted else None
            if grid is None:  # a view: nothing allocated for the norms and the like
                return np.broadcast_to(np.float32(np.nan), file.shapes[name])
            return grid[i]

        tensors = file.tensors(family.GGUF_TENSORS, spec.num_layers, transform, values)
        params = family.params_from_hf(tensors, spec, GRID_DTYPE)
        layers = [
            {k: x for k, x in layer.items() if is_param_info(info[k]) and info[k].matmul}
            for layer, info in zip(params["layers"], infos, strict=True)
        ]
        return layers, params["lm_head"] if "lm_head" in params else params["embed"].T

    (scales, head_d), (offsets, head_m) = part(0), part(1)
    layers = [
        {k: (d[k], m[k]) for k in d if not np.isnan(d[k]).any()}
        for d, m in zip(scales, offsets, strict=True)
    ]
    if not any(layers):
        return None
    grids: Params = {"layers": layers}
    if not np.isnan(head_d).any():
        grids["lm_head"] = (head_d, head_m)
    return grids


def _cast_all_but_grids(params: Params, grids: Params, dtype: Any) -> Params:
    """Every array of `params` cast to `dtype` but the weights `grids` holds (a tied head
    with a grid gets its own float32 copy of the table as lm_head, [H, V])."""
    params = dict(params)
    if "lm_head" in grids and "lm_head" not in params:
        params["lm_head"] = np.ascontiguousarray(params["embed"].T)
    if np.dtype(dtype) == np.float32:
        return params
    held = {"lm_head"} if "lm_head" in grids else set()
    params = {k: v if k == "layers" or k in held else cast(v, dtype) for k, v in params.items()}
    params["layers"] = [
        {k: x if k in grid else cast(x, dtype) for k, x in layer.items()}
        for layer, grid in zip(params["layers"], grids["layers"], strict=True)
    ]
    return params


def load_tokenizer(path: Path) -> Any | None:
    """transformers.AutoTokenizer from `path` (a GGUF file: built from its metadata); None
    (with a warning) if it has no tokenizer."""
    if is_gguf_path(path):
        tokenizer = gguf_tokenizer(GGUFFile(path))
        if tokenizer is None:
            logger.warning("no tokenizer in %s's metadata: only token-id prompts will work", path)
        return tokenizer
    if not any(
        (path / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        logger.warning("no tokenizer files in %s: only token-id prompts will work", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
