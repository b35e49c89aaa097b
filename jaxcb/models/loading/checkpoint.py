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
This module reads one (the loader's side); models/loading/checkpoint_convert.py writes one
(`scripts/convert_checkpoint.py`), from a Hugging Face directory or a GGUF file (its tensors
dequantized; config.json, generation_config.json and tokenizer files written from its
metadata); `LLM(path)` loads any of these formats.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from jaxcb.models.base import ModelSpec, Params
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
