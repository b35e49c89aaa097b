"""Resolve a model path (or the built-in default) into spec, params, tokenizer and EOS ids.

A model path is a Hugging Face directory (config.json + safetensors) or a jaxcb orbax
checkpoint (scripts/convert_checkpoint.py; models/checkpoint.py); both hold config.json.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxcb.models import registry
from jaxcb.models.base import ModelSpec, Params
from jaxcb.models.registry import spec_from_hf_config
from jaxcb.models.weights import CheckpointTensors, ModelLoadError, read_hf_config, read_safetensors

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: Path
    spec: ModelSpec
    params: Params  # numpy arrays in host memory (HF), or jax arrays already sharded (orbax)
    tokenizer: Any | None  # transformers tokenizer, or None if the directory has none
    eos_token_ids: tuple[int, ...]
    is_default: bool
    format: str = "safetensors"  # "safetensors" (Hugging Face) or "orbax"


def load_model(
    model: str | Path | None,
    *,
    tokenizer_path: str | Path | None,
    dtype: Any,
    shardings: Callable[[ModelSpec], Any] | None = None,
) -> LoadedModel:
    """`shardings(spec)`: the params' target shardings. An orbax checkpoint is restored
    straight into them; safetensors are read into host memory (the runner places them). It is
    called before any weight is read, so a model that cannot be sharded fails fast."""
    is_default = model is None
    if is_default:
        from jaxcb.models.default_model import default_model_dir

        path = default_model_dir()
        logger.warning(
            "no model given: using the built-in tiny Llama at %s. Its weights are RANDOM, so "
            "its text is noise; pass a Hugging Face model directory for real output",
            path,
        )
    else:
        path = Path(model).expanduser()
    spec = spec_from_hf_config(read_hf_config(path))
    target = shardings(spec) if shardings is not None else None
    from jaxcb.models.checkpoint import is_orbax_checkpoint, restore_params

    fmt = "orbax" if is_orbax_checkpoint(path) else "safetensors"
    if fmt == "orbax":
        params = restore_params(path, spec, dtype, target)
    else:
        params = load_params(path, spec, dtype)
    tokenizer = load_tokenizer(Path(tokenizer_path) if tokenizer_path else path)
    eos = set(spec.eos_token_ids)
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{gen_path} is not valid JSON: {exc}") from exc
        eos |= set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return LoadedModel(path, spec, params, tokenizer, tuple(sorted(eos)), is_default, fmt)


def load_params(model_dir: str | Path, spec: ModelSpec, dtype: Any) -> Params:
    """Read, check, fuse and cast a Hugging Face checkpoint's tensors into the params pytree
    of `spec`'s family (host numpy arrays)."""
    tensors = CheckpointTensors(read_safetensors(model_dir), model_dir)
    params = registry.family(spec).params_from_hf(tensors, spec, dtype)
    tensors.warn_unused()
    return params


def load_tokenizer(path: Path) -> Any | None:
    """transformers.AutoTokenizer from `path`; None (with a warning) if it has no tokenizer."""
    if not any(
        (path / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        logger.warning("no tokenizer files in %s: only token-id prompts will work", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
