"""jaxcb's own checkpoint format: the params pytree as an orbax checkpoint, model files beside.

    <dir>/
      jaxcb_checkpoint.json   marker: format, version, dtype, where it was converted from
      config.json             the Hugging Face config (the loader reads it as for HF dirs)
      generation_config.json  tokenizer files ...   copied from the source, when present
      params/                 orbax (OCDBT + tensorstore) checkpoint of the params pytree

The params are stored already fused and transposed into their family's layout (its
`param_infos`), so loading does no host-side work: each device reads its own shard of each
array straight into the target sharding (`restore_params` with a tensor-parallel mesh reads
1/N of the bytes per device, and on a multi-host mesh each host reads only what its devices
hold).
`scripts/convert_checkpoint.py` writes one, from a Hugging Face directory or a GGUF file (its
tensors dequantized; config.json, generation_config.json and tokenizer files written from its
metadata); `LLM(path)` loads any of these formats.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from jaxcb.models.base import ModelSpec, Params
from jaxcb.models.gguf import is_gguf_path
from jaxcb.models.weights import ModelLoadError

logger = logging.getLogger(__name__)

MARKER = "jaxcb_checkpoint.json"
FORMAT = "jaxcb-orbax-params"
VERSION = 1  # bump when a family's params layout (its param_infos) changes
PARAMS_DIR = "params"
#: Model files copied beside the params: config, generation config, tokenizer, chat template.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


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
    from jaxcb.models.loader import load_params, read_hf_config, spec_from_hf_config
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

    from jaxcb.models.gguf import GGUFFile
    from jaxcb.models.gguf_tokenizer import gguf_tokenizer
    from jaxcb.models.loader import load_gguf_for
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


def checkpoint_quantization(path: str | Path) -> str:
    """The quantization a jaxcb checkpoint's weights are stored in ("none" or "int8")."""
    return str(_read_marker(Path(path)).get("quantization", "none"))


def restore_params(
    path: str | Path, spec: ModelSpec, dtype: Any, shardings: Any | None = None
) -> Params:
    """Read the params of a jaxcb checkpoint directly into `shardings` (a pytree of
    shardings matching the unquantized params; None: the default device), cast to `dtype`.
    Quantized weights (checkpoint_quantization) come back as they were stored: int8 codes
    and float16 scales, each part on its weight's sharding."""
    import jax
    import orbax.checkpoint as ocp

    from jaxcb.models.base import abstract_from_infos, is_param_info
    from jaxcb.models.quant import quantized_head_infos, quantized_infos
    from jaxcb.models.registry import param_infos

    path = Path(path)
    marker = _read_marker(path)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ModelLoadError(
            f"{path / MARKER} describes format {marker.get('format')!r} version "
            f"{marker.get('version')!r}; this jaxcb reads {FORMAT!r} version {VERSION}: "
            "convert the Hugging Face checkpoint again"
        )
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise ModelLoadError(f"{path} has no {PARAMS_DIR}/ directory")
    checkpointer = ocp.StandardCheckpointer()
    stored = checkpointer.metadata(params_dir.absolute())
    stored = getattr(stored, "item_metadata", stored)  # StepMetadata in newer orbax versions
    stored = getattr(stored, "tree", stored)
    infos = param_infos(spec)
    if shardings is None:
        device = jax.devices()[0]
        shardings = jax.tree_util.tree_map(
            lambda _: jax.sharding.SingleDeviceSharding(device), infos, is_leaf=is_param_info
        )
    quantization = str(marker.get("quantization", "none"))
    if quantization != "none":  # each part of a quantized weight on the weight's sharding
        shardings = {**shardings, "layers": [
            {k: {"q": s, "scale": s, "min": s} if is_param_info(info[k]) and info[k].matmul
             else s for k, s in layer.items()}
            for layer, info in zip(shardings["layers"], infos["layers"], strict=True)
        ]}  # fmt: skip
    target_infos = quantized_infos(infos, quantization)
    head = dict(stored).get("lm_head")
    if head is None:  # a tied table converted before it was quantized as the head
        target_infos = {k: v for k, v in target_infos.items() if k != "lm_head"}
    elif quantization != "none" and isinstance(head, dict) and {"q", "scale"} <= set(head):
        # a quantized head (from GGUF blocks, or a tied table's): on the table's sharding
        target_infos = quantized_head_infos(target_infos, quantization)
        s = shardings.get("lm_head", shardings["embed"])
        if "lm_head" not in infos and isinstance(s, jax.sharding.NamedSharding):
            s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
        shardings = {**shardings, "lm_head": {k: s for k in target_infos["lm_head"]}}
    target = abstract_from_infos(target_infos, dtype)
    _check_shapes(stored, target, path)
    target = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, shardings
    )
    return checkpointer.restore(params_dir.absolute(), target)


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path / MARKER} is unreadable: {exc}") from exc


def _check_shapes(stored: Any, target: Params, path: Path) -> None:
    """Orbax restores into whatever shape it is asked for; a mismatch must be an error."""
    import jax

    flat_stored = dict(jax.tree_util.tree_flatten_with_path(stored)[0])
    flat_target = dict(jax.tree_util.tree_flatten_with_path(target)[0])
    missing = sorted(jax.tree_util.keystr(k) for k in flat_target.keys() - flat_stored.keys())
    extra = sorted(jax.tree_util.keystr(k) for k in flat_stored.keys() - flat_target.keys())
    if missing or extra:
        raise ModelLoadError(
            f"the params in {path} do not match config.json: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for key, want in flat_target.items():
        have = tuple(flat_stored[key].shape)
        if have != tuple(want.shape):
            raise ModelLoadError(
                f"parameter {jax.tree_util.keystr(key)} in {path} has shape {have}, expected "
                f"{tuple(want.shape)} from config.json"
            )
