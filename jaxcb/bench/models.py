"""Benchmark models, built once and cached: seeded random-weight Hugging Face checkpoints
(bench-57m) and the real model, SmolLM2-135M-Instruct (`smollm2-135m`, see bench/smollm2.py).

`bench_model_dir("bench-57m")` returns a model directory written by transformers'
`save_pretrained` (config.json, model.safetensors, generation_config.json; no tokenizer:
offline benchmark prompts are token ids). `bench_model_dir(name, with_tokenizer=True)` is the
same weights (hard links) plus a word-level tokenizer in which token id i is the word "w<i>",
for serving benchmarks: every generated token then streams as visible text (" w123"), so the
servers (jaxcb's and `vllm serve`) send one content chunk per token and TTFT / ITL are
measured per token. `python -m jaxcb.bench.models bench-57m --with-tokenizer` prints its path.

The weights come from `torch.manual_seed(0)` and transformers' own initialisation, so every
machine builds the same model, and jaxcb and the peers read the very same file.

`smollm2-135m` is the installed Q4_1 GGUF dequantized to a float32 HF directory with its own
tokenizer and chat template (so `with_tokenizer` changes nothing); `python -m
jaxcb.bench.models smollm2-135m --gguf f32 --llamacpp-dir DIR` prints (and writes first) the
GGUF file llama.cpp runs at that precision.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from jaxcb.paths import build_atomically, cache_dir

logger = logging.getLogger(__name__)

#: name -> transformers LlamaConfig keyword arguments (see shared/BENCHMARKS.md, "Models").
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "bench-57m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
}
#: The real model's preset (bench/smollm2.py builds it); every script's --model takes it.
REAL_MODELS = ("smollm2-135m",)
MODEL_PRESETS = (*BENCH_MODELS, *REAL_MODELS)
SEED = 0
VERSION = "v1"  # bump when a model's recipe changes, so stale caches are not reused


def bench_model_dir(
    name: str = "bench-57m", *, root: Path | None = None, with_tokenizer: bool = False
) -> Path:
    """Directory of benchmark model `name`, building it first if this machine has not yet;
    `with_tokenizer`: the variant with a word-level tokenizer (see the module docstring)."""
    if name in REAL_MODELS:
        from jaxcb.bench.smollm2 import smollm2_hf_dir

        return smollm2_hf_dir(root)
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {list(MODEL_PRESETS)}")
    base = (root or cache_dir()) / f"{name}-{VERSION}"
    target = base.with_name(base.name + "-words") if with_tokenizer else base
    if (target / "config.json").is_file():
        return target
    if with_tokenizer:
        base = bench_model_dir(name, root=root)

        def write(tmp: Path) -> None:
            for f in base.iterdir():
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
            save_word_tokenizer(tmp, BENCH_MODELS[name]["vocab_size"])
    else:

        def write(tmp: Path) -> None:
            write_llama(tmp, BENCH_MODELS[name], seed=SEED)

    build_atomically(target, write)
    logger.info("built benchmark model %s", target)
    return target


def write_llama(path: Path, config: dict[str, Any], *, seed: int = SEED) -> None:
    """Initialise a float32 Llama with transformers under `torch.manual_seed(seed)`, save it."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.save_pretrained(path)


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer whose token i is the word "w<i>" (0-2: <unk>, <s>, </s>), split on spaces:
    any id sequence decodes to distinct, non-empty words and encodes back to the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab |= {f"w{i}": i for i in range(len(specials), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build (once) and print a benchmark model dir.")
    parser.add_argument("name", nargs="?", default="bench-57m", choices=MODEL_PRESETS)
    parser.add_argument("--with-tokenizer", action="store_true", help="the word-tokenizer variant")
    parser.add_argument("--gguf", choices=["f32", "bf16", "q4_1"], help="smollm2-135m's GGUF file")
    parser.add_argument("--llamacpp-dir", type=Path, help="llama.cpp source dir (its converter)")
    parser.add_argument("--convert-python", help="python running the converter (default: this)")
    cli = parser.parse_args()
    if cli.gguf:
        from jaxcb.bench.smollm2 import smollm2_gguf_file

        if cli.name not in REAL_MODELS:
            parser.error(f"--gguf is for {REAL_MODELS}")
        print(
            smollm2_gguf_file(
                cli.gguf, llamacpp_dir=cli.llamacpp_dir, convert_python=cli.convert_python
            )
        )
    else:
        print(bench_model_dir(cli.name, with_tokenizer=cli.with_tokenizer))
