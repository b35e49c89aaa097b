"""Model families by name, and the lookups from a checkpoint to its family.

A family is a module implementing the interface in base.py. Adding one is one new file and
one entry in FAMILIES below: everything else (config mapping, parameter declarations with
their sharding axes, weight names, forward) lives in the family's file. A family that reads
GGUF files also declares GGUF_TENSORS (llama.cpp's tensor names -> its Hugging Face names),
config_from_gguf(metadata, shapes) -> a Hugging Face config, and tensor_from_gguf(hf_name, x,
spec=, arch=), which undoes what llama.cpp's converter changed in a tensor's layout.

A GGUF arch name does not always say which family a file needs: llama.cpp writes Mixtral as
"llama", a Llama whose layers hold experts. A family claims such files by a tensor only they
hold, in GGUF_ARCHS_BY_TENSOR: {(arch, GGUF tensor name): architecture} (moe.py's
{("llama", "blk.0.ffn_gate_inp.weight"): "MixtralForCausalLM"}: a router in layer 0). That
table is asked first, then GGUF_ARCHS, so the plain arch stays the default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jax

from jaxcb.models import gemma, llama, moe, phi3
from jaxcb.models.base import ModelSpec, Params, abstract_from_infos, is_param_info
from jaxcb.models.loading.gguf import GGUFFile
from jaxcb.models.weights import ModelLoadError

#: family name (ModelSpec.family) -> its module
FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "phi3": phi3,
    "gemma": gemma,
    "moe": moe,
}


def _table(attribute: str) -> dict[Any, tuple[ModuleType, str]]:
    """key -> (family, Hugging Face architecture), from each family's own tables."""
    out: dict[str, tuple[ModuleType, str]] = {}
    for family in FAMILIES.values():
        table = getattr(family, attribute, ())  # (a family may read no GGUF files)
        pairs = table.items() if isinstance(table, dict) else ((a, a) for a in table)
        for key, architecture in pairs:
            out[key] = (family, architecture)
    return out


ARCHITECTURES = _table("ARCHITECTURES")  # HF `architectures` entry
MODEL_TYPES = _table("MODEL_TYPES")  # config.json `model_type`
GGUF_ARCHS = _table("GGUF_ARCHS")  # GGUF `general.architecture`
GGUF_ARCHS_BY_TENSOR = _table("GGUF_ARCHS_BY_TENSOR")  # (that arch, a tensor it holds)


def family(spec_or_name: ModelSpec | str) -> ModuleType:
    """The family module of a spec (or of a family name)."""
    name = spec_or_name.family if isinstance(spec_or_name, ModelSpec) else spec_or_name
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def resolve_hf_architecture(cfg: dict[str, Any]) -> tuple[ModuleType, str]:
    """The family and architecture of a Hugging Face config.json: its first `architectures`
    entry jaxcb runs, or (configs saved without a model class) its `model_type`."""
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, list):
        raise ModelLoadError(f"config.json: architectures must be a list, got {architectures!r}")
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if not architectures and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    shown = ", ".join(map(str, architectures)) or str(model_type)
    raise ModelLoadError(
        f"unsupported architecture {shown!r}; jaxcb supports {sorted(ARCHITECTURES)}"
    )


def resolve_gguf_architecture(
    name: str, source: str | Path = "GGUF", shapes: Mapping[str, Any] | None = None
) -> tuple[ModuleType, str]:
    """The family and (Hugging Face) architecture of a GGUF `general.architecture` whose
    file holds the tensors `shapes` names (GGUF_ARCHS_BY_TENSOR first, then GGUF_ARCHS);
    `source` (the file) prefixes the error."""
    for (arch, tensor), found in GGUF_ARCHS_BY_TENSOR.items():
        if arch == name and tensor in (shapes or {}):
            return found
    if name not in GGUF_ARCHS:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {name!r}; jaxcb supports {sorted(GGUF_ARCHS)}"
        )
    return GGUF_ARCHS[name]


def spec_from_gguf(file: GGUFFile) -> tuple[dict[str, Any], ModelSpec]:
    """The Hugging Face config its family maps a GGUF file's metadata to, and the spec of
    that config; an error names the file."""
    module, architecture = resolve_gguf_architecture(file.architecture, file.path, file.shapes)
    cfg = module.config_from_gguf(file.metadata, file.shapes)
    try:
        return cfg, module.spec_from_hf_config(cfg, architecture)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{file.path}: {exc}") from None


def spec_from_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """Map a Hugging Face config.json onto the spec of the family that runs it."""
    module, architecture = resolve_hf_architecture(cfg)
    return module.spec_from_hf_config(cfg, architecture)


def param_infos(spec: ModelSpec) -> Params:
    """The params pytree of `spec` as ParamInfo (shapes and logical axes)."""
    return family(spec).param_infos(spec)


def abstract_params(spec: ModelSpec, dtype: Any) -> Params:
    """The params pytree of `spec` as ShapeDtypeStructs."""
    return abstract_from_infos(param_infos(spec), dtype)


def num_params(spec: ModelSpec) -> int:
    """Parameters of the model (tied embeddings counted once)."""
    leaves = jax.tree_util.tree_leaves(param_infos(spec), is_leaf=is_param_info)
    return sum(math.prod(info.shape) for info in leaves)
