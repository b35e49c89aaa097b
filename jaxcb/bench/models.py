"""Benchmark models: seeded random-weight Hugging Face checkpoints, built once and cached.

`bench_model_dir("bench-57m")` returns a model directory written by transformers'
`save_pretrained` (config.json, model.safetensors, generation_config.json; no tokenizer:
benchmark prompts are token ids). The weights come from `torch.manual_seed(0)` and
transformers' own initialisation, so every machine builds the same model, and jaxcb and the
peers read the very same file.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jaxcb.models.default_model import cache_dir

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
SEED = 0
VERSION = "v1"  # bump when a model's recipe changes, so stale caches are not reused


def bench_model_dir(name: str = "bench-57m", *, root: Path | None = None) -> Path:
    """Directory of benchmark model `name`, building it first if this machine has not yet."""
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {sorted(BENCH_MODELS)}")
    target = (root or cache_dir()) / f"{name}-{VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_llama(tmp, BENCH_MODELS[name], seed=SEED)
        try:
            os.replace(tmp, target)  # atomic: a concurrent builder may win, which is fine
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built benchmark model %s in %s", name, target)
    return target


def write_llama(path: Path, config: dict[str, Any], *, seed: int = SEED) -> None:
    """Initialise a float32 Llama with transformers under `torch.manual_seed(seed)`, save it."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.save_pretrained(path)
