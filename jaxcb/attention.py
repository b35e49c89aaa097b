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


ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")


def resolve_backend(name: str, platform: str | None = None) -> str:
    """The concrete backend: "xla", "pallas-tpu" or "pallas-gpu".

    "auto" is pallas on TPU and GPU and xla on CPU; "pallas" is this platform's kernel (the
    GPU one on CPU, where it runs in interpret mode).
    """
    platform = platform or jax.default_backend()
    if name == "auto":
        name = "pallas" if platform in ACCELERATORS else "xla"
    if name == "pallas":
        name = "pallas-tpu" if platform == "tpu" else "pallas-gpu"
    if name not in ("xla", "pallas-tpu", "pallas-gpu"):
        raise ValueError(
            f"unknown attention backend {name!r}; valid: auto, xla, pallas, pallas-tpu, pallas-gpu"
        )
    kernel_platform = name.removeprefix("pallas-")
    if (
        name != "xla"
        and platform in ACCELERATORS
        and (platform == "tpu") != (kernel_platform == "tpu")
    ):
        raise ValueError(f"attention={name!r} cannot run on {platform}")
    return name


def get_attention_fn(name: str, platform: str | None = None) -> AttentionFn:
    platform = platform or jax.default_backend()
    backend = resolve_backend(name, platform)
    if backend == "xla":
        return ragged_paged_attention_xla
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    interpret = platform not in ACCELERATORS
    if interpret:
        logger.warning(
            "attention=%s on %s runs the kernel in interpret mode: correct but very slow, "
            "meant for tests; use attention=xla for speed on CPU",
            backend,
            platform,
        )
    return functools.partial(
        ragged_paged_attention, backend=backend.removeprefix("pallas-"), interpret=interpret
    )
