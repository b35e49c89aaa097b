"""Convert a Hugging Face model directory or a GGUF file into a jaxcb orbax checkpoint.

    python scripts/convert_checkpoint.py /path/to/hf_model /path/to/jaxcb_ckpt [--dtype bfloat16]
    python scripts/convert_checkpoint.py model.Q4_1.gguf /path/to/jaxcb_ckpt
    python scripts/convert_checkpoint.py /path/to/hf_model /path/to/jaxcb_int8 --quantization int8

The output holds the params pytree, already fused and laid out as jaxcb computes with it, as
an orbax checkpoint (params/), with config.json, generation_config.json and the tokenizer
files beside it (for a GGUF file: its tensors dequantized, those files written from its
metadata). With `--quantization int8` the layer matmul weights are stored as int8 codes with
float16 scales (models/quant.py; a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks as the file has
them), and an engine loading it runs them so. `LLM("/path/to/jaxcb_ckpt")`, `serve.py
--model ...` and every script load it like a Hugging Face directory, and restore each array
straight into its target sharding (with tensor_parallel_size > 1, each device reads only its
shard). See models/loading/checkpoint.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jaxcb.models.loading.checkpoint_convert import convert_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "source", help="Hugging Face model directory (config.json + safetensors) or GGUF file"
    )
    parser.add_argument("target", help="directory to write the jaxcb checkpoint to")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="stored dtype (auto: the checkpoint's own; GGUF's quantized blocks become float32)",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "int8"),
        default="none",
        help="store the layer matmul weights as int8 codes + float16 scales (see "
        "docs/quantization.md); the engine then runs them quantized",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing target")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    try:
        target = convert_checkpoint(
            args.source,
            args.target,
            dtype=args.dtype,
            force=args.force,
            quantization=args.quantization,
        )
    except ValueError as exc:  # ModelLoadError included
        parser.exit(2, f"convert_checkpoint.py: error: {exc}\n")
    print(f"wrote {target} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
