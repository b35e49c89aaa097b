"""Native CPU kernels (C++, XLA FFI): ragged paged attention and the in-place KV write.

The source ships with the package and is compiled on first use with the system's C++
compiler into the jaxcb cache directory (keyed by the source, jaxlib version and compiler
flags), then registered with jax as FFI targets for the CPU platform. If no compiler is
available, `available()` is False and the engine uses the pure-XLA path instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ragged_paged_attention.cc")
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
]
ATTENTION_TARGET = "jaxcb_ragged_paged_attention"
KV_WRITE_TARGET = "jaxcb_kv_write"


class NativeBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _cpu_signature() -> bytes:
    """What -march=native depends on: a library built for one CPU may not run on another
    (a cache directory shared between machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor().encode()
    return "\n".join(
        sorted({ln for ln in lines if ln.startswith(("flags", "model name"))})
    ).encode()


def _library_path() -> Path:
    from jaxcb.models.default_model import cache_dir

    key = hashlib.sha256(
        SOURCE.read_bytes() + jax.__version__.encode() + " ".join(FLAGS).encode() + _cpu_signature()
    ).hexdigest()[:16]
    return cache_dir() / "native" / f"jaxcb_cpu_kernels-{key}.so"


def _build(target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        logger.info("compiling jaxcb's native CPU kernels: %s", " ".join(cmd))
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeBuildError(f"compiling {SOURCE.name} failed:\n{result.stderr[-4000:]}")
        os.replace(out, target)  # atomic: concurrent builders are fine


@functools.cache
def _load() -> bool:
    path = _library_path()
    if not path.is_file():
        _build(path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in (
        (ATTENTION_TARGET, lib.JaxcbRaggedPagedAttention),
        (KV_WRITE_TARGET, lib.JaxcbKvWrite),
    ):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
    return True


def available() -> bool:
    """Whether the kernels are built (building them now if needed) and registered."""
    try:
        return _load()
    except (NativeBuildError, OSError) as exc:
        logger.warning("native CPU kernels unavailable, using the XLA path: %s", exc)
        return False


def ragged_paged_attention_native(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention on CPU (same contract as the jnp reference)."""
    _load()
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


def write_kv_native(
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]
) -> tuple[jax.Array, jax.Array]:
    """In-place KV page write on CPU, for float32 and bfloat16 pools alike."""
    _load()
    shapes = (
        jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
    )
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, shapes, input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, k, v, slot_mapping.astype(jnp.int32))
