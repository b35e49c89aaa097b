"""Attention backend choice: "xla" (plain jnp; the CPU path and the reference) or "pallas".

Every backend has the kernel-shaped signature of
`pallas_kernels.ragged_paged_attention.ragged_paged_attention_reference`.
"""

from __future__ import annotations

import functools
import logging

import jax

from jaxcb.models.llama import AttentionFn
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

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
        return ragged_paged_attention_reference
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
