"""Building and loading jaxcb's native CPU kernels, one library per ISA level.

The C++ sources (attention.cc, matmul.cc, lora.cc over common.h / simd.h; read_probe.cc, the
memory's read bandwidth for benchmarks) are compiled once per ISA level into the jaxcb cache
directory, never with -march=native: a library is built for a named level (x86-64-v3 for
"avx2", x86-64-v4 for "avx512", ...), keyed by the sources, jaxlib version and flags, and
loaded only on a CPU whose flags hold everything that level needs, so a cache directory
shared between machines never hands one CPU another's code.

The *active* level is the highest this CPU fits (capped by the JAXCB_CPU_ISA environment
variable: the forced-ISA switch, e.g. JAXCB_CPU_ISA=avx2 runs the AVX2 kernels on an AVX-512
machine); attention, the KV write and the AVX-512 / AMX matmuls run from its library. The
AVX2 matmuls always run from the "avx2" library, so a test can check both on one machine.
Each library's functions are registered with jax as XLA FFI targets named `<base>_<level>`.
`available()` is False (and the engine takes the XLA path) when no compiler is found or the
build fails; a CPU below AVX2 (or not x86) gets the "generic" library: attention and the KV
write, matmuls on XLA.

The op wrappers that call these targets live in attention.py, matmul.py, grouped.py,
normed.py and lora.py; this module knows nothing of them but their target names. It imports
nothing from jaxcb but the cache directory (jaxcb.paths).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax

from jaxcb.paths import cache_dir

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "attention.cc", _HERE / "matmul.cc", _HERE / "lora.cc", _HERE / "read_probe.cc"]
HEADERS = [_HERE / "common.h", _HERE / "simd.h", _HERE / "quant_matmul.h"]
FLAGS = [
    "-O3",
    "-fopenmp-simd",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-Wl,-Bsymbolic",  # a library's calls stay in it, whatever else the process loaded
]
#: The environment variable that caps the ISA level (a name of ISA_LEVELS).
ISA_ENV = "JAXCB_CPU_ISA"

ATTENTION_TARGET = "jaxcb_ragged_paged_attention"
KV_WRITE_TARGET = "jaxcb_kv_write"
KV_WRITE_QUANT_TARGET = "jaxcb_kv_write_quant"
MATMUL_AMX_TARGET = "jaxcb_matmul_amx"
LORA_ADD_F32_TARGET = "jaxcb_lora_add_f32"
LORA_ADD_BF16_TARGET = "jaxcb_lora_add_bf16"
MATMUL_F32_TARGET = "jaxcb_matmul_f32"
SWIGLU_F32_TARGET = "jaxcb_swiglu_f32"
MATMUL_ARGMAX_F32_TARGET = "jaxcb_matmul_argmax_f32"
MATMUL_BF16_DOT_TARGET = "jaxcb_matmul_bf16_dot"
SWIGLU_BF16_DOT_TARGET = "jaxcb_swiglu_bf16_dot"
MATMUL_ARGMAX_BF16_DOT_TARGET = "jaxcb_matmul_argmax_bf16_dot"
MATMUL_BF16_WIDE_TARGET = "jaxcb_matmul_bf16_wide"
SWIGLU_BF16_WIDE_TARGET = "jaxcb_swiglu_bf16_wide"
MATMUL_ARGMAX_BF16_WIDE_TARGET = "jaxcb_matmul_argmax_bf16_wide"
MATMUL_ARGMAX_SCREENED_F32_TARGET = "jaxcb_matmul_argmax_screened_f32"
MATMUL_INT8_TARGET = "jaxcb_matmul_int8"
SWIGLU_INT8_TARGET = "jaxcb_swiglu_int8"
MATMUL_INT4_TARGET = "jaxcb_matmul_int4"
SWIGLU_INT4_TARGET = "jaxcb_swiglu_int4"
NORM_MATMUL_F32_TARGET = "jaxcb_norm_matmul_f32"
NORM_SWIGLU_F32_TARGET = "jaxcb_norm_swiglu_f32"
NORM_MATMUL_BF16_WIDE_TARGET = "jaxcb_norm_matmul_bf16_wide"
NORM_SWIGLU_BF16_WIDE_TARGET = "jaxcb_norm_swiglu_bf16_wide"
NORM_MATMUL_BF16_DOT_TARGET = "jaxcb_norm_matmul_bf16_dot"
NORM_SWIGLU_BF16_DOT_TARGET = "jaxcb_norm_swiglu_bf16_dot"
NORM_MATMUL_INT8_TARGET = "jaxcb_norm_matmul_int8"
NORM_SWIGLU_INT8_TARGET = "jaxcb_norm_swiglu_int8"
NORM_MATMUL_INT4_TARGET = "jaxcb_norm_matmul_int4"
NORM_SWIGLU_INT4_TARGET = "jaxcb_norm_swiglu_int4"
GROUPED_MATMUL_AMX_TARGET = "jaxcb_grouped_matmul_amx"
GROUPED_MATMUL_F32_TARGET = "jaxcb_grouped_matmul_f32"
GROUPED_SWIGLU_F32_TARGET = "jaxcb_grouped_swiglu_f32"
GROUPED_MATMUL_BF16_WIDE_TARGET = "jaxcb_grouped_matmul_bf16_wide"
GROUPED_SWIGLU_BF16_WIDE_TARGET = "jaxcb_grouped_swiglu_bf16_wide"
GROUPED_MATMUL_BF16_DOT_TARGET = "jaxcb_grouped_matmul_bf16_dot"
GROUPED_SWIGLU_BF16_DOT_TARGET = "jaxcb_grouped_swiglu_bf16_dot"


class NativeBuildError(RuntimeError):
    pass


class IsaLevel(NamedTuple):
    name: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the CPU must show
    compile_flags: tuple[str, ...]
    about: str


_V3 = frozenset(
    {"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16", "xsave"}  # x86-64-v2 and the OS state
    | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}  # x86-64-v3
)
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_V4_ARGS = ("-march=x86-64-v4",)
#: The ISA levels, lowest first: each library holds everything its level can run.
ISA_LEVELS = {
    level.name: level
    for level in (
        IsaLevel("generic", frozenset(), (), "no vector ISA assumed: attention, KV write"),
        IsaLevel("avx2", _V3, ("-march=x86-64-v3",), "AVX2 + FMA (x86-64-v3)"),
        IsaLevel("avx512", _V4, _V4_ARGS, "AVX-512 F/BW/CD/DQ/VL (x86-64-v4)"),
        IsaLevel(
            "avx512_bf16",
            _V4 | {"avx512_bf16"},
            (*_V4_ARGS, "-mavx512bf16"),
            "AVX-512 with AVX512-BF16 dot products",
        ),
        IsaLevel(
            "amx",
            _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
            (*_V4_ARGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
            "AVX512-BF16 and AMX bf16 tiles",
        ),
    )
}
#: The CPU flags worth printing beside a figure (benchmarks, stats()).
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere: the generic level)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R45", ...), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_summary() -> str:
    """The model and the flags that decide the kernels, for a line beside a figure."""
    flags = cpu_flags()
    shown = " ".join(f for f in RELEVANT_FLAGS if f in flags) or "none of avx2/avx512/amx"
    return f"{cpu_model()} ({shown})"


def supported_levels() -> list[str]:
    """The ISA levels this CPU can run, lowest first ("generic" always)."""
    flags = cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return ["generic"]
    return [name for name, level in ISA_LEVELS.items() if level.cpu_flags <= flags]


def isa_cap() -> str | None:
    """The level named by JAXCB_CPU_ISA, or None; a name that is not a level is an error."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected auto or one of {', '.join(ISA_LEVELS)}")
    return value


def active_level() -> str:
    """The highest level this CPU fits, at most JAXCB_CPU_ISA."""
    levels = supported_levels()
    cap = isa_cap()
    if cap is not None:
        order = list(ISA_LEVELS)
        levels = [lv for lv in levels if order.index(lv) <= order.index(cap)]
    return levels[-1]


def level_at_least(level: str, floor: str) -> bool:
    order = list(ISA_LEVELS)
    return order.index(level) >= order.index(floor)


def target(base: str, level: str) -> str:
    """The FFI target name of `base` in the library of `level`."""
    return f"{base}_{level}"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _library_path(level: IsaLevel) -> Path:
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + jax.__version__.encode()
        + " ".join(FLAGS + list(level.compile_flags)).encode()
    ).hexdigest()[:16]
    return cache_dir() / "native" / f"jaxcb_cpu_kernels-{level.name}-{key}.so"


def _build(level: IsaLevel, target_path: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    target_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_path.parent) as tmp:
        out = Path(tmp) / target_path.name
        common = [compiler, *FLAGS, *level.compile_flags]
        # Each source to an object at once, side by side (the cores a first run or a test
        # worker waiting on this build would leave idle; ~2x faster on 2 cores), then linked.
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        compiles = [
            [*common, "-c", f"-I{jax.ffi.include_dir()}", str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        logger.info(
            "compiling jaxcb's native CPU kernels (%s): %s", level.name, " ".join(compiles[0])
        )
        running = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for cmd in compiles]
        errors = [proc.communicate()[1] for proc in running]  # (each waited for)
        failed = [
            f"{source.name}:\n{err[-4000:]}"
            for source, err, proc in zip(SOURCES, errors, running, strict=True)
            if proc.returncode != 0
        ]
        if not failed:
            link = subprocess.run(
                [*common, *map(str, objects), "-o", str(out)], capture_output=True, text=True
            )
            if link.returncode != 0:
                failed.append(f"linking:\n{link.stderr[-4000:]}")
        if failed:
            raise NativeBuildError(f"compiling for {level.name} failed: " + "\n".join(failed))
        os.replace(out, target_path)  # atomic: concurrent builders are fine


class Features(NamedTuple):
    """What one loaded library runs (beyond attention and the KV write)."""

    v16: bool  # the f32 and widened-bf16 matmuls and the screened argmax (AVX2 or better)
    bf16_dot: bool  # the vdpbf16ps matmuls (AVX512-BF16)
    amx: bool  # the AMX matmul, with the tile state granted by the kernel


@functools.cache
def _open(name: str) -> ctypes.CDLL:
    level = ISA_LEVELS[name]
    path = _library_path(level)
    if not path.is_file():
        # One builder at a time per library: processes starting together (test workers,
        # server replicas, jax.distributed peers) wait for the first one's build (~20 s)
        # instead of each compiling the same library.
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.is_file():
                _build(level, path)
    return ctypes.cdll.LoadLibrary(str(path))


@functools.cache
def _load_level(name: str) -> Features:
    lib = _open(name)
    path = _library_path(ISA_LEVELS[name])
    bits = int(lib.JaxcbIsaFeatures())
    features = Features(v16=bool(bits & 1), bf16_dot=bool(bits & 4), amx=bool(bits & 8))
    symbols = [
        (ATTENTION_TARGET, "JaxcbRaggedPagedAttention"),
        (KV_WRITE_TARGET, "JaxcbKvWrite"),
        (KV_WRITE_QUANT_TARGET, "JaxcbKvWriteQuant"),
    ]
    if features.v16:
        symbols += [
            (MATMUL_F32_TARGET, "JaxcbMatmulF32"),
            (SWIGLU_F32_TARGET, "JaxcbSwigluF32"),
            (MATMUL_ARGMAX_F32_TARGET, "JaxcbMatmulArgmaxF32"),
            (MATMUL_BF16_WIDE_TARGET, "JaxcbMatmulBf16Wide"),
            (SWIGLU_BF16_WIDE_TARGET, "JaxcbSwigluBf16Wide"),
            (MATMUL_ARGMAX_BF16_WIDE_TARGET, "JaxcbMatmulArgmaxBf16Wide"),
            (MATMUL_ARGMAX_SCREENED_F32_TARGET, "JaxcbMatmulArgmaxScreenedF32"),
            (NORM_MATMUL_F32_TARGET, "JaxcbNormMatmulF32"),
            (NORM_SWIGLU_F32_TARGET, "JaxcbNormSwigluF32"),
            (NORM_MATMUL_BF16_WIDE_TARGET, "JaxcbNormMatmulBf16Wide"),
            (NORM_SWIGLU_BF16_WIDE_TARGET, "JaxcbNormSwigluBf16Wide"),
            (MATMUL_INT8_TARGET, "JaxcbMatmulInt8"),
            (SWIGLU_INT8_TARGET, "JaxcbSwigluInt8"),
            (MATMUL_INT4_TARGET, "JaxcbMatmulInt4"),
            (SWIGLU_INT4_TARGET, "JaxcbSwigluInt4"),
            (NORM_MATMUL_INT8_TARGET, "JaxcbNormMatmulInt8"),
            (NORM_SWIGLU_INT8_TARGET, "JaxcbNormSwigluInt8"),
            (NORM_MATMUL_INT4_TARGET, "JaxcbNormMatmulInt4"),
            (NORM_SWIGLU_INT4_TARGET, "JaxcbNormSwigluInt4"),
            (GROUPED_MATMUL_F32_TARGET, "JaxcbGroupedMatmulF32"),
            (GROUPED_SWIGLU_F32_TARGET, "JaxcbGroupedSwigluF32"),
            (GROUPED_MATMUL_BF16_WIDE_TARGET, "JaxcbGroupedMatmulBf16Wide"),
            (GROUPED_SWIGLU_BF16_WIDE_TARGET, "JaxcbGroupedSwigluBf16Wide"),
            (LORA_ADD_F32_TARGET, "JaxcbLoraAddF32"),
            (LORA_ADD_BF16_TARGET, "JaxcbLoraAddBf16"),
        ]
    if features.bf16_dot:
        symbols += [
            (MATMUL_BF16_DOT_TARGET, "JaxcbMatmulBf16Dot"),
            (SWIGLU_BF16_DOT_TARGET, "JaxcbSwigluBf16Dot"),
            (MATMUL_ARGMAX_BF16_DOT_TARGET, "JaxcbMatmulArgmaxBf16Dot"),
            (NORM_MATMUL_BF16_DOT_TARGET, "JaxcbNormMatmulBf16Dot"),
            (NORM_SWIGLU_BF16_DOT_TARGET, "JaxcbNormSwigluBf16Dot"),
            (GROUPED_MATMUL_BF16_DOT_TARGET, "JaxcbGroupedMatmulBf16Dot"),
            (GROUPED_SWIGLU_BF16_DOT_TARGET, "JaxcbGroupedSwigluBf16Dot"),
        ]
    if features.amx:
        symbols += [
            (MATMUL_AMX_TARGET, "JaxcbMatmulAmx"),
            (GROUPED_MATMUL_AMX_TARGET, "JaxcbGroupedMatmulAmx"),
        ]
    for base, symbol in symbols:
        capsule = jax.ffi.pycapsule(getattr(lib, symbol))
        jax.ffi.register_ffi_target(target(base, name), capsule, platform="cpu")
    logger.info("jaxcb native CPU kernels loaded: %s (%s)", name, path.name)
    return features


def load(level: str | None = None) -> Features:
    """Build the library of `level` (default: the active one) if needed, load it and register
    its FFI targets (once per process and level)."""
    name = level or active_level()
    if name not in supported_levels():
        raise NativeBuildError(f"this CPU cannot run the {name} kernels ({cpu_summary()})")
    return _load_level(name)


#: AVX2's two micro-tile shapes for many-row products (matmul.cc, TileShape): "wide" (2 rows
#: x 3 blocks of 16 columns) or "tall" (6 x 1; 4 x 1 for widened bf16).
TILE_SHAPES = ("wide", "tall")


def tile_shapes(level: str | None = None) -> dict[str, str]:
    """The AVX2 tile shape the many-row products of `level`'s library (default: the active
    one) take on this CPU, per weight form ("f32", "bf16": widened), probing the CPU now if
    that was not done yet. The AVX-512 libraries have one shape: "wide" for both."""
    bits = int(_open(level or active_level()).JaxcbTallTiles())
    return {form: TILE_SHAPES[bool(bits & bit)] for form, bit in (("f32", 1), ("bf16", 2))}


def force_tile_shape(shape: str | None, level: str | None = None) -> None:
    """Force the AVX2 tile shape ("wide" / "tall") of `level`'s library, or give the choice
    back to the CPU probe (None). Results do not depend on it (each output sums along K in
    the same order); tests and benchmarks run both shapes on one machine with it."""
    if shape is not None and shape not in TILE_SHAPES:
        raise ValueError(f"tile shape must be one of {TILE_SHAPES} or None, got {shape!r}")
    choice = -1 if shape is None else TILE_SHAPES.index(shape)
    _open(level or active_level()).JaxcbForceTiles(choice)


def read_bandwidth(nbytes: int, threads: int | None = None, passes: int = 10) -> float:
    """The best of `passes` reads of an `nbytes` buffer by `threads` threads (default: the
    usable cores), in bytes per second, with the widest loads of the active level's library
    (read_probe.cc): the memory's read limit that a decode step's weight stream meets. The
    buffer is written once first, so its pages exist before the timed passes."""
    import numpy as np  # (jax's own dependency)

    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    buf = np.ones(max(int(nbytes), 512 * threads) // 4, np.float32)
    fn = _open(active_level()).JaxcbReadBandwidth
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return float(fn(buf.ctypes.data, buf.nbytes, int(threads), int(passes)))


def registered_target(base: str, level: str) -> str:
    """The FFI target of `base` in the library of `level`, built and registered now if not
    yet (at trace time)."""
    load(level)
    return target(base, level)


def available() -> bool:
    """Whether the active level's library is built (building it now if needed) and
    registered."""
    try:
        load()
    except (NativeBuildError, OSError) as exc:
        logger.warning("native CPU kernels unavailable, using the XLA path: %s", exc)
        return False
    return True
