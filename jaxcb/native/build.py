"""Building and loading jaxcb's native CPU kernels: compile the C++ sources once per machine
into one library in the jaxcb cache directory (keyed by the sources, jaxlib version, compiler
flags and CPU), load it with ctypes and register its functions with jax as XLA FFI targets for
the CPU platform. `available()` is False (and the engine takes the XLA path) when no compiler
is found or the build fails.

The op wrappers that call these targets live in ops.py; this module knows nothing of them but
their target names. It imports nothing from jaxcb but the cache directory (jaxcb.paths).
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
from typing import NamedTuple

import jax

from jaxcb.paths import cache_dir

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "attention.cc", _HERE / "matmul.cc"]
HEADERS = [_HERE / "common.h"]
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
MATMUL_AMX_TARGET = "jaxcb_matmul_amx"
MATMUL_AVX512_BF16_TARGET = "jaxcb_matmul_avx512_bf16"
MATMUL_AVX512_F32_TARGET = "jaxcb_matmul_avx512_f32"
SWIGLU_AVX512_BF16_TARGET = "jaxcb_swiglu_avx512_bf16"
SWIGLU_AVX512_F32_TARGET = "jaxcb_swiglu_avx512_f32"
MATMUL_ARGMAX_AVX512_BF16_TARGET = "jaxcb_matmul_argmax_avx512_bf16"
MATMUL_ARGMAX_AVX512_F32_TARGET = "jaxcb_matmul_argmax_avx512_f32"
MATMUL_ARGMAX_SCREENED_F32_TARGET = "jaxcb_matmul_argmax_screened_f32"


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
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + jax.__version__.encode()
        + " ".join(FLAGS).encode()
        + _cpu_signature()
    ).hexdigest()[:16]
    return cache_dir() / "native" / f"jaxcb_cpu_kernels-{key}.so"


def _build(target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(out)]
        logger.info("compiling jaxcb's native CPU kernels: %s", " ".join(cmd))
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            names = ", ".join(p.name for p in SOURCES)
            raise NativeBuildError(f"compiling {names} failed:\n{result.stderr[-4000:]}")
        os.replace(out, target)  # atomic: concurrent builders are fine


class Features(NamedTuple):
    """What the loaded library can run on this CPU (each beyond attention and the KV write)."""

    amx: bool  # built with AMX and the tile state granted by the kernel
    avx512_bf16: bool  # built with -mavx512bf16
    avx512: bool  # built with -mavx512f


@functools.cache
def load() -> Features:
    """Build the library if needed, load it, register its FFI targets (once per process)."""
    path = _library_path()
    if not path.is_file():
        _build(path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    features = Features(
        amx=bool(lib.JaxcbAmxAvailable()),
        avx512_bf16=bool(lib.JaxcbAvx512Bf16Available()),
        avx512=bool(lib.JaxcbAvx512Available()),
    )
    targets = [
        (ATTENTION_TARGET, lib.JaxcbRaggedPagedAttention),
        (KV_WRITE_TARGET, lib.JaxcbKvWrite),
    ]
    if features.amx:
        targets.append((MATMUL_AMX_TARGET, lib.JaxcbMatmulAmx))
    if features.avx512_bf16:
        targets.append((MATMUL_AVX512_BF16_TARGET, lib.JaxcbMatmulBf16Avx512))
        targets.append((SWIGLU_AVX512_BF16_TARGET, lib.JaxcbSwigluBf16Avx512))
        targets.append((MATMUL_ARGMAX_AVX512_BF16_TARGET, lib.JaxcbMatmulArgmaxBf16Avx512))
        targets.append((MATMUL_ARGMAX_SCREENED_F32_TARGET, lib.JaxcbMatmulArgmaxScreenedF32))
    if features.avx512:
        targets.append((MATMUL_AVX512_F32_TARGET, lib.JaxcbMatmulF32Avx512))
        targets.append((SWIGLU_AVX512_F32_TARGET, lib.JaxcbSwigluF32Avx512))
        targets.append((MATMUL_ARGMAX_AVX512_F32_TARGET, lib.JaxcbMatmulArgmaxF32Avx512))
    for name, symbol in targets:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
    return features


def available() -> bool:
    """Whether the kernels are built (building them now if needed) and registered."""
    try:
        load()
    except (NativeBuildError, OSError) as exc:
        logger.warning("native CPU kernels unavailable, using the XLA path: %s", exc)
        return False
    return True


def amx_available() -> bool:
    """Whether `matmul_amx` can run: the kernels built, this CPU has AMX (bf16 tiles), and
    the operating system granted the process its tile state."""
    return available() and load().amx


def avx512_bf16_available() -> bool:
    """Whether `matmul_avx512_bf16` can run: the kernels built for a CPU with AVX512-BF16."""
    return available() and load().avx512_bf16


def avx512_available() -> bool:
    """Whether `matmul_avx512_f32` can run: the kernels built for a CPU with AVX-512."""
    return available() and load().avx512


def argmax_screen_available() -> bool:
    """Whether `matmul_argmax_screened_f32` can run (AVX-512 and AVX512-BF16)."""
    return avx512_available() and avx512_bf16_available()
