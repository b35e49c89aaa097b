"""Small GGUF files for tests, written as llama.cpp's converter writes them.

A Hugging Face model directory (tests/helpers.py's tiny random models) becomes a GGUF file:
gguf's own tensor-name map (not jaxcb's), q/k rows permuted for the "llama" arch as
convert_hf_to_gguf.py does, matrices stored in the requested type (norms and biases stay
F32, as llama.cpp keeps them), hyperparameters as metadata, and optionally a byte-level BPE
tokenizer with a ChatML template.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from jaxcb.models.weights import read_safetensors

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "phi3": gguf.MODEL_ARCH.PHI3,  # fused attn_qkv, and ffn_up holding gate and up
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows to interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(hf_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and in its layout (float32)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(ARCHS[arch], cfg["num_hidden_layers"])
    out = {}
    for hf_name, x in read_safetensors(hf_dir).items():
        base, suffix = hf_name.rsplit(".", 1)
        x = np.asarray(x, np.float32)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = (
                cfg["num_attention_heads"]
                if base.endswith("q_proj")
                else cfg["num_key_value_heads"]
            )
            x = llama_cpp_permute(x, heads)
        out[f"{names.get_name(base)}.{suffix}"] = x
    return out


def write_gguf(
    path: Path,
    hf_dir: Path,
    *,
    arch: str = "llama",
    qtype: str = "F32",
    qtypes: dict[str, str] | None = None,
    tokenizer: bool = False,
    tensors: dict[str, np.ndarray] | None = None,
    drop_keys: tuple[str, ...] = (),
    extra_keys: dict[str, object] | None = None,
) -> Path:
    """Write `hf_dir`'s model as a GGUF file of `arch` with matrices in `qtype`.

    `qtypes`: GGUF tensor name -> its type instead of `qtype` (a mixed file); `tensors`:
    replacements or additions (stored as given, by numpy dtype); `drop_keys`: metadata keys
    (after "<arch>.") left out; `extra_keys`: more metadata (full keys)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.dimension_count": cfg.get("head_dim")
        or cfg["hidden_size"] // cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
    }
    if cfg.get("head_dim"):
        keys["attention.key_length"] = keys["attention.value_length"] = cfg["head_dim"]
    if arch == "phi3" and cfg.get("sliding_window"):
        keys["attention.sliding_window"] = cfg["sliding_window"]
    for key, value in keys.items():
        if key not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    for key, value in (extra_keys or {}).items():
        writer.add_key_value(key, value, _value_type(value))
    if tokenizer:
        _add_byte_tokenizer(writer)
    for name, x in {**gguf_tensors(hf_dir, arch), **(tensors or {})}.items():
        quant = gguf.GGMLQuantizationType[(qtypes or {}).get(name, qtype)]
        if name in (tensors or {}) or x.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, x)
        elif quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, x.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(x, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stored(x: np.ndarray, qtype: str) -> np.ndarray:
    """What a matrix written in `qtype` reads back as (float32)."""
    quant = gguf.GGMLQuantizationType[qtype]
    if quant == gguf.GGMLQuantizationType.F32:
        return x
    if quant == gguf.GGMLQuantizationType.F16:
        return x.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(x, quant), quant)


def _add_byte_tokenizer(writer: gguf.GGUFWriter) -> None:
    """Three control tokens, the 256 byte characters, and a few merges."""
    chars = sorted(set(_byte_chars().values()), key=lambda c: ord(c))
    merges = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt h"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = SPECIALS + chars + merged
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(chars) + len(merged)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def _byte_chars() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _value_type(value: object) -> gguf.GGUFValueType:
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32
