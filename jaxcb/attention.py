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
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb import native
from jaxcb.config import ATTENTION_BACKENDS
from jaxcb.models.base import AttentionBackend
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

logger = logging.getLogger(__name__)

ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")
#: The KV page dtypes the native CPU kernels read (quantized ones with their scales).
NATIVE_KV_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2")


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


def check_kv_cache_dtype(
    backend: str, kv_dtype: Any, requested: str, platform: str | None = None
) -> None:
    """A one-line ValueError naming kv_cache_dtype when the concrete `backend` cannot read
    pages of `kv_dtype` (`requested`: the config's value); a warning when it reads them only
    slowly. Every backend reads float32, bfloat16, int8 and both fp8 pages."""
    name = jnp.dtype(kv_dtype).name
    if backend == "native" and name not in NATIVE_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={requested!r} gives {name} KV pages, which attention='native' "
            "cannot read (float32, bfloat16, int8, fp8, fp8_e5m2); choose one of those, or "
            "attention='xla'"
        )
    float8 = name in ("float8_e4m3fn", "float8_e5m2")
    if backend == "xla" and float8 and (platform or jax.default_backend()) == "cpu":
        logger.warning(
            "kv_cache_dtype=%r with attention='xla' on CPU: XLA's CPU backend converts a "
            "float8 pool to float32 and back on every KV write (the whole pool, each layer, "
            "each step); attention='native' writes it in place, and int8 pages are written "
            "in place by XLA too",
            requested,
        )


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
            "native",
            native.ragged_paged_attention_native,
            native.write_kv_native,
            native.copy_kv_native,
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
