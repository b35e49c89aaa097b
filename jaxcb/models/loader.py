"""Resolve a model (a path, a built-in name, a hub id, or None: the default) into spec,
params, tokenizer and EOS ids.

A model path is a Hugging Face directory (config.json + safetensors), a jaxcb orbax
checkpoint (scripts/convert_checkpoint.py; models/checkpoint.py), both holding config.json,
or a GGUF file (models/gguf.py), whose metadata holds the config, tokenizer and chat template.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from jaxcb.models import registry
from jaxcb.models.base import ModelSpec, Params
from jaxcb.models.default_model import NAME as TINY_NAME
from jaxcb.models.default_model import SMOLLM2_NAME, builtin_model
from jaxcb.models.gguf import GGUFFile, is_gguf_path
from jaxcb.models.gguf_tokenizer import gguf_tokenizer
from jaxcb.models.hub import download, looks_like_hub_id
from jaxcb.models.registry import spec_from_gguf, spec_from_hf_config
from jaxcb.models.weights import (
    CheckpointTensors,
    ModelLoadError,
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
) -> LoadedModel:
    """`shardings(spec)`: the params' target shardings. An orbax checkpoint is restored
    straight into them; safetensors and GGUF tensors (dequantized) are read into host memory
    (the runner places them). It is called before any weight is read, so a model that cannot
    be sharded fails fast."""
    path, random_weights = resolve_model(model)
    if is_gguf_path(path):
        return _load_gguf(path, tokenizer_path, dtype, shardings, random_weights)
    spec = spec_from_hf_config(read_hf_config(path))
    target = shardings(spec) if shardings is not None else None
    from jaxcb.models.checkpoint import is_orbax_checkpoint, restore_params

    fmt = "orbax" if is_orbax_checkpoint(path) else "safetensors"
    if fmt == "orbax":
        params = restore_params(path, spec, dtype, target)
    else:
        params = load_params(path, spec, dtype)
    tokenizer = load_tokenizer(Path(tokenizer_path) if tokenizer_path else path)
    eos = _eos_ids(spec, generation_eos(path), tokenizer)
    return LoadedModel(path, spec, params, tokenizer, eos, random_weights, fmt)


def _load_gguf(
    path: Path,
    tokenizer_path: str | Path | None,
    dtype: Any,
    shardings: Callable[[ModelSpec], Any] | None,
    random_weights: bool,
) -> LoadedModel:
    """A GGUF file: config, tokenizer and stop tokens from its metadata, its tensors
    dequantized to `dtype` in host memory (the runner places them)."""
    file = GGUFFile(path)
    _, spec = spec_from_gguf(file)
    if shardings is not None:
        shardings(spec)  # fails fast if the model cannot be sharded
    params = load_gguf_params(file, spec, dtype)
    tokenizer = load_tokenizer(Path(tokenizer_path)) if tokenizer_path else gguf_tokenizer(file)
    eos = _eos_ids(spec, set(file.stop_token_ids()), tokenizer)
    return LoadedModel(path, spec, params, tokenizer, eos, random_weights, "gguf")


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
