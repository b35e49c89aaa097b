"""LoRA adapters as PEFT saves them: a directory with `adapter_config.json` and
`adapter_model.safetensors`.

`read_adapter` returns each adapted module's low-rank pair in Hugging Face's terms (layer,
module name such as "q_proj", A [r, in], B [out, r]) with its scale (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA; `rank_pattern` and `alpha_pattern` override both per
module as PEFT reads them). What jaxcb cannot apply is refused here with one line naming
it (DoRA, trained biases, modules saved whole, embedding adapters); whether the modules
and shapes fit the base model is jaxcb.lora's to check, which knows the layout.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxcb.models.weights import ModelLoadError, read_safetensors_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name such as
# ".default" may follow lora_A in some saves)
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:[\w.]+\.)?(\w+)\.lora_([AB])"
    r"(?:\.\w+)?\.weight$"
)


@dataclass(frozen=True)
class LoraPair:
    """One adapted module of one layer: delta W x = scale * B (A x)."""

    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter read from `path`: its pairs by (layer index, module name)."""

    path: Path
    rank: int  # the largest of its modules'
    pairs: dict[tuple[int, str], LoraPair] = field(repr=False)

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.pairs}


def read_adapter(path: str | Path) -> Adapter:
    """The adapter saved in directory `path` (ModelLoadError, one line, if it is not one
    jaxcb can apply)."""
    path = Path(path).expanduser()
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ModelLoadError(f"LoRA adapter {path}: no {CONFIG_FILE} (not a PEFT adapter dir)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"LoRA adapter {path}: {CONFIG_FILE} is not valid JSON: {exc}"
        ) from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"LoRA adapter {path}: {CONFIG_FILE} must hold a JSON object")
    _check_supported(config, path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ModelLoadError(
            f"LoRA adapter {path}: no {WEIGHTS_FILE} (adapters saved as .bin are not read; "
            "save with safe_serialization=True)"
        )
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in read_safetensors_file(weights).items():
        match = _TENSOR.match(name)
        if match is None:
            raise ModelLoadError(
                f"LoRA adapter {path}: tensor {name!r} is not a layer's lora_A / lora_B "
                "(embedding or output-head adapters are not supported)"
            )
        layer, module, half = int(match[1]), match[2], match[3]
        if tensor.ndim != 2:
            raise ModelLoadError(f"LoRA adapter {path}: {name} has shape {tensor.shape}, not 2-D")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise ModelLoadError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA tensors")
    pairs = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise ModelLoadError(
                f"LoRA adapter {path}: layer {layer} {module} has no lora_{missing} tensor"
            )
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise ModelLoadError(
                f"LoRA adapter {path}: layer {layer} {module} has lora_A {a.shape} and lora_B "
                f"{b.shape}, whose ranks differ"
            )
        scale = _scale(config, f"layers.{layer}.{module}", a.shape[0])
        pairs[layer, module] = LoraPair(a, b, scale)
    return Adapter(path=path, rank=max(p.rank for p in pairs.values()), pairs=pairs)


def _check_supported(config: dict[str, Any], path: Path) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ModelLoadError(f"LoRA adapter {path}: peft_type {peft_type!r} is not LORA")
    if config.get("use_dora"):
        raise ModelLoadError(f"LoRA adapter {path}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(
            f"LoRA adapter {path}: trained biases (bias={config['bias']!r}) are not supported"
        )
    if config.get("modules_to_save"):
        raise ModelLoadError(
            f"LoRA adapter {path}: modules saved whole ({config['modules_to_save']}) are not "
            "supported"
        )
    if config.get("target_parameters"):
        raise ModelLoadError(
            f"LoRA adapter {path}: adapters of parameters (target_parameters "
            f"{config['target_parameters']}, such as experts' weights) are not supported"
        )
    if config.get("fan_in_fan_out"):
        raise ModelLoadError(f"LoRA adapter {path}: fan_in_fan_out (Conv1D bases) is not supported")


def _scale(config: dict[str, Any], module_path: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), the module's alpha from alpha_pattern
    where a pattern names it, as PEFT matches them (the key ends the module's name)."""
    alpha = config.get("lora_alpha", 8)
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            alpha = value
            break
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
