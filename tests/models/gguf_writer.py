"""Small GGUF files for tests, written as llama.cpp's converter writes them.

A Hugging Face model directory (tests/helpers.py's tiny random models) becomes a GGUF file:
gguf's own tensor-name map (not jaxcb's), q/k rows permuted for the "llama" arch as
convert_hf_to_gguf.py does, Gemma's norm weights stored as 1 + w, each layer's experts
stacked into one [E, out, in] tensor per projection (Mixtral as the "llama" arch), matrices
stored in the requested type (norms, biases and routers stay F32, as llama.cpp keeps them),
hyperparameters as metadata, and optionally a byte-level BPE tokenizer with a ChatML
template.
"""

from __future__ import annotations

import functools
import json
import re
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
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
}
#: GGUF tensors llama.cpp keeps in F32 whatever the file's type (as it does 1-D ones): routers
F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
#: a per-expert Hugging Face name: (the experts' prefix, expert, projection)
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)$")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows to interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str, arch: str, num_layers: int) -> str:
    """llama.cpp's name of a Hugging Face tensor (a per-expert one: its layer's stack).

    Names the arch's own map lacks are Llama's: the dense layers of a Qwen3-MoE with
    mlp_only_layers (ffn_gate/up/down), and an untied Gemma 2's head ("output"; llama.cpp
    drops Gemma 2's lm_head, tied in every release, but the tiny test model is untied)."""
    base, suffix = hf_name.rsplit(".", 1)
    if match := EXPERT.match(base):
        base = f"{match[1]}.{match[3]}"  # the experts' "merged" name
    maps = (_name_map(arch, num_layers), _name_map("llama", num_layers))
    name = maps[0].get_name(base) or maps[1].get_name(base)
    assert name, hf_name
    return f"{name}.{suffix}"


@functools.cache
def _name_map(arch: str, num_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(ARCHS[arch], num_layers)


def gguf_tensors(hf_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and in its layout (float32)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}  # stack name -> expert -> matrix
    for hf_name, x in read_safetensors(hf_dir).items():
        base = hf_name.rsplit(".", 1)[0]
        x = np.asarray(x, np.float32)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = (
                cfg["num_attention_heads"]
                if base.endswith("q_proj")
                else cfg["num_key_value_heads"]
            )
            x = llama_cpp_permute(x, heads)
        if arch.startswith("gemma") and base.endswith("norm"):
            x = x + np.float32(1.0)  # ggml's RMSNorm multiplies by the weight itself
        name = gguf_name(hf_name, arch, cfg["num_hidden_layers"])
        if match := EXPERT.match(base):
            experts.setdefault(name, {})[int(match[2])] = x
        else:
            out[name] = x
    for name, stack in experts.items():
        out[name] = np.stack([stack[e] for e in sorted(stack)])  # [E, out, in]
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
    if arch in ("phi3", "gemma2", "gemma3") and cfg.get("sliding_window"):
        keys["attention.sliding_window"] = cfg["sliding_window"]
    if arch == "gemma3" and cfg.get("sliding_window_pattern", 6) != 6:
        # llama.cpp assumes Gemma 3's five sliding layers to a global one without the key
        keys["attention.sliding_window_pattern"] = cfg["sliding_window_pattern"]
    if "num_experts_per_tok" in cfg:
        keys["expert_count"] = cfg.get("num_local_experts") or cfg["num_experts"]
        keys["expert_used_count"] = cfg["num_experts_per_tok"]
    if arch in ("qwen2moe", "qwen3moe"):
        keys["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if arch == "qwen2moe":
        keys["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    for key, value in keys.items():
        if key not in drop_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            writer.add_float32(f"{arch}.{key}", cfg[key])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers (the local: 10000)
    theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    for key, value in (extra_keys or {}).items():
        writer.add_key_value(key, value, _value_type(value))
    if tokenizer:
        _add_byte_tokenizer(writer)
    for name, x in {**gguf_tensors(hf_dir, arch), **(tensors or {})}.items():
        quant = gguf.GGMLQuantizationType[(qtypes or {}).get(name, qtype)]
        if (
            name in (tensors or {})
            or x.ndim == 1
            or name.endswith(F32_TENSORS)
            or quant == gguf.GGMLQuantizationType.F32
        ):
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
