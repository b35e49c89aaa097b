"""Attention backend choice.

- "native": jaxcb's C++ CPU kernels through XLA FFI (jaxcb/native): ragged paged attention
  that reads each page once, and an in-place KV write that also works for bfloat16 pools.
  Compiled on first use; the CPU default when a C++ compiler is present.
- "xla": `ragged_paged_attention_xla`, plain XLA with work proportional to the live lengths;
  the CPU fallback.
- "pallas" / "pallas-tpu" / "pallas-gpu": the Pallas kernels (Mosaic TPU, Triton GPU);
  interpret mode on CPU, for tests.
- "auto": pallas on TPU and GPU, native (else xla) on CPU.

Every backend is checked against `ragged_paged_attention_reference` and has its
kernel-shaped signature.
"""

from __future__ import annotations

import functools
import logging

import jax

from jaxcb import native
from jaxcb.config import ATTENTION_BACKENDS
from jaxcb.models.base import AttentionBackend
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

logger = logging.getLogger(__name__)

ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")


def resolve_backend(name: str, platform: str | None = None) -> str:
    """The concrete backend: "native", "xla", "pallas-tpu" or "pallas-gpu"."""
    platform = platform or jax.default_backend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; valid: {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == "auto":  # (native.available() builds the library: only ask on CPUs)
        name = "pallas" if platform in ACCELERATORS else _cpu_default()
    if name == "pallas":
        name = "pallas-tpu" if platform == "tpu" else "pallas-gpu"
    if name == "native" and platform in ACCELERATORS:
        raise ValueError(f"attention='native' is a CPU kernel and cannot run on {platform}")
    wrong_kernel = (platform == "tpu") != (name == "pallas-tpu")
    if name.startswith("pallas-") and platform in ACCELERATORS and wrong_kernel:
        raise ValueError(f"attention={name!r} cannot run on {platform}")
    return name


def _cpu_default() -> str:
    return "native" if native.available() else "xla"


def get_attention_backend(name: str, platform: str | None = None) -> AttentionBackend:
    platform = platform or jax.default_backend()
    backend = resolve_backend(name, platform)
    if backend == "xla":
        return AttentionBackend("xla", ragged_paged_attention_xla)
    if backend == "native":
        if not native.available():
            raise ValueError("attention='native' needs a C++ compiler (g++ or $CXX)")
        return AttentionBackend(
            "native", native.ragged_paged_attention_native, native.write_kv_native
        )
    interpret = platform not in ACCELERATORS
    if interpret:
        logger.warning(
            "attention=%s on %s runs the kernel in interpret mode: correct but very slow, "
            "meant for tests; use attention=native or xla for speed on CPU",
            backend,
            platform,
        )
    kernel = functools.partial(
        ragged_paged_attention, backend=backend.removeprefix("pallas-"), interpret=interpret
    )
    return AttentionBackend(backend, kernel)
