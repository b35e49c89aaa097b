"""Writing jaxcb checkpoints (models/loading/checkpoint.py has the format and reads them): a Hugging
Face directory or a GGUF file converted into the params pytree of its family, optionally
quantized, saved with orbax beside the model files. `scripts/convert_checkpoint.py` runs it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from jaxcb.models.base import Params
from jaxcb.models.loading.checkpoint import FORMAT, MARKER, PARAMS_DIR, SIDE_FILES, VERSION
from jaxcb.models.loading.gguf import is_gguf_path
from jaxcb.models.loading.loader import (
    load_gguf_for,
    load_params,
    read_hf_config,
    spec_from_hf_config,
)

logger = logging.getLogger(__name__)


def convert_checkpoint(
    source: str | Path,
    target: str | Path,
    *,
    dtype: str = "auto",
    force: bool = False,
    quantization: str = "none",
) -> Path:
    """Convert a Hugging Face model directory or a GGUF file into a jaxcb orbax checkpoint,
    its layer matmul weights quantized if `quantization` is "int8" (models/quant.py; a GGUF
    file's Q8_0 / Q4_0 / Q4_1 blocks as they are)."""
    if is_gguf_path(source):
        return convert_gguf_checkpoint(
            source, target, dtype=dtype, force=force, quantization=quantization
        )
    return convert_hf_checkpoint(
        source, target, dtype=dtype, force=force, quantization=quantization
    )


def convert_hf_checkpoint(
    source: str | Path,
    target: str | Path,
    *,
    dtype: str = "auto",
    force: bool = False,
    quantization: str = "none",
) -> Path:
    """Convert a Hugging Face model directory into a jaxcb orbax checkpoint.

    `dtype`: "float32", "bfloat16", "float16", or "auto" (the checkpoint's own: bfloat16 and
    float16 stay as they are, anything else becomes float32). An engine of another dtype can
    still load it: restoring casts (quantized weights stay int8 codes and float16 scales).
    """
    from jaxcb.models.quant import quantize_params
    from jaxcb.models.registry import param_infos

    source = Path(source).expanduser()
    config = read_hf_config(source)
    spec = spec_from_hf_config(config)
    if dtype == "auto":
        stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        dtype = stored if stored in ("bfloat16", "float16") else "float32"
    params = load_params(source, spec, _numpy_dtype(dtype))
    params, _ = quantize_params(params, param_infos(spec), quantization)
    return save_checkpoint(
        params, target, source=source, dtype=dtype, force=force, quantization=quantization
    )


def convert_gguf_checkpoint(
    source: str | Path,
    target: str | Path,
    *,
    dtype: str = "auto",
    force: bool = False,
    quantization: str = "none",
) -> Path:
    """Convert a GGUF file into a jaxcb orbax checkpoint: its tensors dequantized to `dtype`
    ("auto": bfloat16 if the file stores its matrices so, else float32), or with "int8" its
    layer matmul weights as int8 (block-quantized ones exactly as the file has them), with
    config.json, generation_config.json (its stop tokens) and the tokenizer built from its
    metadata."""
    import tempfile

    from jaxcb.models.loading.gguf import GGUFFile
    from jaxcb.models.loading.gguf_tokenizer import gguf_tokenizer
    from jaxcb.models.quant import quantize_params
    from jaxcb.models.registry import param_infos, spec_from_gguf

    file = GGUFFile(source)
    config, spec = spec_from_gguf(file)
    dtype = file.stored_dtype() if dtype == "auto" else dtype
    params, grids = load_gguf_for(file, spec, _numpy_dtype(dtype), quantization)
    params, _ = quantize_params(params, param_infos(spec), quantization, grids)
    with tempfile.TemporaryDirectory() as files:
        config = {**config, "torch_dtype": dtype}
        (Path(files) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": spec.bos_token_id, "eos_token_id": file.stop_token_ids()}
        (Path(files) / "generation_config.json").write_text(json.dumps(generation) + "\n")
        tokenizer = gguf_tokenizer(file)
        if tokenizer is not None:
            tokenizer.save_pretrained(files)
        return save_checkpoint(
            params,
            target,
            source=file.path,
            dtype=dtype,
            force=force,
            model_files=Path(files),
            quantization=quantization,
        )


def _numpy_dtype(dtype: str) -> Any:
    import ml_dtypes
    import numpy as np

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be auto, {', '.join(dtypes)}, got {dtype!r}")
    return dtypes[dtype]


def save_checkpoint(
    params: Params,
    target: str | Path,
    *,
    source: str | Path,
    dtype: str,
    force: bool = False,
    model_files: Path | None = None,
    quantization: str = "none",
) -> Path:
    """Write `params` (numpy or jax arrays; quantized as `quantization` says) and the model
    files (config, tokenizer...) of `model_files` (default: the `source` directory) to
    `target`."""
    import orbax.checkpoint as ocp

    target = Path(target).expanduser().absolute()
    model_files = Path(model_files or source)
    if target.exists():
        if not force:
            raise ValueError(f"{target} exists; pass force=True (--force) to overwrite it")
        shutil.rmtree(target)
    target.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    copied = []
    for name in SIDE_FILES:
        if (model_files / name).is_file():
            shutil.copy2(model_files / name, target / name)
            copied.append(name)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "quantization": quantization,
        "source": str(source),
    }
    (target / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks it complete
    logger.info("wrote %s (params + %s)", target, ", ".join(copied))
    return target
