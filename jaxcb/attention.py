"""Attention backend choice: "xla" (the CPU path) or "pallas" (TPU / GPU kernels).

"xla" is `ragged_paged_attention_xla`: plain XLA with work proportional to the live lengths,
checked against `ragged_paged_attention_reference` like the kernels are. Every backend has
the reference's kernel-shaped signature.
"""

from __future__ import annotations

import functools
import logging

import jax

from jaxcb.models.llama import AttentionFn
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

logger = logging.getLogger(__name__)


def resolve_backend(name: str, platform: str | None = None) -> str:
    """ "auto" → "pallas" on TPU and GPU, "xla" on CPU."""
    platform = platform or jax.default_backend()
    if name == "auto":
        return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "xla"
    return name


def get_attention_fn(name: str, platform: str | None = None) -> AttentionFn:
    platform = platform or jax.default_backend()
    backend = resolve_backend(name, platform)
    if backend == "xla":
        return ragged_paged_attention_xla
    if backend == "pallas":
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention

        kernel_backend = "tpu" if platform == "tpu" else "gpu"
        interpret = platform not in ("tpu", "gpu", "cuda", "rocm")
        if interpret:
            logger.warning(
                "attention=pallas on %s runs the kernels in interpret mode: correct but very "
                "slow, meant for tests; use attention=xla for speed on CPU",
                platform,
            )
        return functools.partial(
            ragged_paged_attention, backend=kernel_backend, interpret=interpret
        )
    raise ValueError(f"unknown attention backend {name!r}; valid: auto, xla, pallas")
