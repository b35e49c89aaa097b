"""Load a Hugging Face model directory (config.json + safetensors) into a params pytree.

Supports single-file checkpoints and sharded ones (`model.safetensors.index.json`), stored
in float32, float16 or bfloat16, converted to the engine dtype. Every failure names the file
or tensor at fault.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxcb.models.llama import SUPPORTED_ARCHITECTURES, ModelSpec, Params

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model directory cannot be loaded (missing file, unsupported model, bad tensor)."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc


def spec_from_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """Map a Hugging Face config.json onto the facts the forward pass needs."""
    architectures = cfg.get("architectures") or []
    if not architectures:  # configs saved without a model class: go by model_type
        by_type = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
        architectures = [by_type.get(cfg.get("model_type"), cfg.get("model_type"))]
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ModelLoadError(
            f"unsupported architecture {', '.join(map(str, architectures))!r}; "
            f"jaxcb supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[supported[0]]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu'")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        spec_args = dict(
            vocab_size=int(cfg["vocab_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from None
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads={num_heads} is not divisible by "
            f"num_key_value_heads={num_kv_heads}"
        )
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)

    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or rope
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in ("linear", "llama3"):
            raise ModelLoadError(
                f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3"
            )

    windows = _sliding_windows(cfg, family, num_layers)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelSpec(
        architecture=supported[0],
        hidden_size=hidden,
        num_layers=num_layers,
        num_q_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_windows=windows,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **spec_args,
    )


def _sliding_windows(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if family == "mistral":
        return (int(window) if window else None,) * num_layers
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
        layer_types = cfg.get("layer_types")
        if layer_types:
            return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
        first_full = int(cfg.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first_full else None for i in range(num_layers))
    return (None,) * num_layers


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc}") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir} (PyTorch .bin checkpoints are not "
            "supported; re-save with save_pretrained(safe_serialization=True))"
        )
    return files


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _read_safetensors_file(path: Path) -> dict[str, np.ndarray]:
    """Memory-map one .safetensors file: an 8-byte header length, a JSON header, raw data.

    Reading it with numpy directly keeps tensors on the host (no trip through a device) and
    handles bfloat16, which safetensors' own numpy reader rejects.
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.size < 8:
        raise ModelLoadError(f"{path} is too short to be a safetensors file")
    header_len = int(raw[:8].view("<u8")[0])
    if header_len <= 0 or 8 + header_len > raw.size:
        raise ModelLoadError(f"{path} has a corrupt safetensors header")
    try:
        header = json.loads(bytes(raw[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} has a corrupt safetensors header: {exc}") from exc
    data = raw[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r} in {path}"
        try:
            dtype_name, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(d) for d in shape)
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{where} has a corrupt header entry: {info!r:.200}") from None
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise ModelLoadError(f"{where} has unsupported dtype {dtype_name}")
        # Offsets against the file's size: a truncated download fails here, by name, and not
        # as a reshape error (or a read past the end of the memory map).
        if not 0 <= start <= end <= data.size:
            raise ModelLoadError(
                f"{where} lies at bytes [{start}, {end}) of the data, but the file has only "
                f"{data.size} bytes of data: it is truncated or corrupt"
            )
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - start != need:
            raise ModelLoadError(
                f"{where} has {end - start} bytes, but shape {list(shape)} of {dtype_name} "
                f"needs {need}: the file is corrupt"
            )
        out[name] = data[start:end].view(dtype).reshape(shape)
    return out


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint as (memory-mapped) numpy arrays."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(Path(model_dir)):
        tensors.update(_read_safetensors_file(path))
    return tensors


def load_params(model_dir: str | Path, spec: ModelSpec, dtype: Any) -> Params:
    """Read, check, fuse and cast the checkpoint's tensors into the params pytree (numpy)."""
    tensors = read_safetensors(model_dir)
    used: set[str] = set()
    h, d = spec.hidden_size, spec.head_dim
    hq, hkv, g = spec.num_q_heads, spec.num_kv_heads, spec.group_size

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"checkpoint in {model_dir} lacks tensor {name!r}")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from config.json"
            )
        used.add(name)
        return t

    def cast(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32).astype(dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        wq = take(p + "self_attn.q_proj.weight", (hq * d, h)).T.reshape(h, hkv, g, d)
        wk = take(p + "self_attn.k_proj.weight", (hkv * d, h)).T.reshape(h, hkv, 1, d)
        wv = take(p + "self_attn.v_proj.weight", (hkv * d, h)).T.reshape(h, hkv, 1, d)
        layer = {
            "attn_norm": cast(take(p + "input_layernorm.weight", (h,))),
            "wqkv": cast(np.concatenate([wq, wk, wv], axis=2)),  # [H, Hkv, G + 2, D]
            "wo": cast(take(p + "self_attn.o_proj.weight", (h, hq * d)).T),
            "mlp_norm": cast(take(p + "post_attention_layernorm.weight", (h,))),
            "w_gate_up": cast(
                np.stack(
                    [
                        take(p + "mlp.gate_proj.weight", (spec.intermediate_size, h)).T,
                        take(p + "mlp.up_proj.weight", (spec.intermediate_size, h)).T,
                    ],
                    axis=1,
                )
            ),  # [H, 2, I]
            "w_down": cast(take(p + "mlp.down_proj.weight", (h, spec.intermediate_size)).T),
        }
        if spec.qkv_bias:
            bq = take(p + "self_attn.q_proj.bias", (hq * d,)).reshape(hkv, g, d)
            bk = take(p + "self_attn.k_proj.bias", (hkv * d,)).reshape(hkv, 1, d)
            bv = take(p + "self_attn.v_proj.bias", (hkv * d,)).reshape(hkv, 1, d)
            layer["bqkv"] = cast(np.concatenate([bq, bk, bv], axis=1))  # [Hkv, G + 2, D]
        if spec.qk_norm:
            layer["q_norm"] = cast(take(p + "self_attn.q_norm.weight", (d,)))
            layer["k_norm"] = cast(take(p + "self_attn.k_norm.weight", (d,)))
        layers.append(layer)

    params: Params = {
        "embed": cast(take("model.embed_tokens.weight", (spec.vocab_size, h))),
        "layers": layers,
        "final_norm": cast(take("model.norm.weight", (h,))),
    }
    if not spec.tie_word_embeddings:
        params["lm_head"] = cast(take("lm_head.weight", (spec.vocab_size, h)).T)
    else:
        used.add("lm_head.weight")  # some tied checkpoints store a copy anyway
    unused = sorted(set(tensors) - used)
    if unused:
        logger.warning("ignoring %d checkpoint tensors, e.g. %s", len(unused), unused[:3])
    return params
