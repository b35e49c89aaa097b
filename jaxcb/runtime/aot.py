"""Compile the step for an accelerator that is not here: every bucket, with the real compiler.

jax compiles for absent targets through compile-only devices
(`jax.experimental.topologies.get_topology_desc`): a TPU slice through libtpu (jax[tpu]), an
H100 through the CUDA plugin (jax[cuda12]) given XLA's description of the GPU
(pallas_kernels/gpu_targets.py). `compile_for_target` builds the project's own ModelRunner on
those devices with abstract parameters and KV pool (`jax.ShapeDtypeStruct`s carrying the
project's shardings: no weights needed, only a config.json), compiles every bucket's step,
and reports per bucket what the compiled program says of itself: memory (memory_analysis),
flops and bytes accessed (cost analysis), hence a roofline time per step. Mosaic and Triton
errors, VMEM and shared-memory overflows surface here as on the real chip.

The KV pool is sized as the engine sizes it on a real device (kv_cache.size_kv_pool): the
target's memory x memory_utilization, less the weights' share and the compiled step's own
buffers, which are measured by compiling the largest bucket once before the pool is sized
(`measure_program_bytes`; one compile more, unless num_pages or kv_cache_memory_gb is given).

Run with JAX_PLATFORMS=cpu set before jax is imported (scripts/aot_compile.py and the
tests' conftest do): the host runs nothing, and jax[cuda12] would otherwise fail to
initialize for want of a GPU, which also takes away its compile-only devices. The report's
figures and the roofline are in aot_report.py.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket
from jaxcb.lora import with_lora_slots
from jaxcb.models import registry
from jaxcb.models.base import ModelSpec, abstract_from_infos
from jaxcb.models.quant import quantized_infos
from jaxcb.runtime import compile_cache, sharding
from jaxcb.runtime.kv_cache import PoolSizing
from jaxcb.runtime.plan import plan_device
from jaxcb.runtime.runner import ModelRunner
from pallas_kernels.gpu_targets import H100_SXM_TARGET_CONFIG

#: Buckets compiled at once by default (ModelRunner.compile's threads; the engine's start-up
#: on accelerators too). XLA compiles independent programs in parallel threads: on 2 busy
#: cores (load ~3.5) the 12 buckets of a Qwen3-8B v5e-4 preset took 838 s with 2 threads
#: against 1112 s with 1 (H100 Llama-3-8B: 131 against 136 s; on 2 idle cores, 2 threads:
#: 86 s), for 10-15% more peak host memory.
DEFAULT_COMPILE_THREADS = min(4, os.cpu_count() or 1)
#: jax's default share of GPU memory its allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION).
JAX_GPU_MEM_FRACTION = 0.75


@dataclass(frozen=True)
class Target:
    """An accelerator the step can be compiled for; figures per chip, dense bf16."""

    name: str
    platform: str  # "tpu" or "cuda" (get_topology_desc's platform)
    num_chips: int
    topology: dict[str, Any]  # get_topology_desc's other arguments
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s

    @property
    def device_platform(self) -> str:
        """The platform its devices report (and the attention backends are chosen by)."""
        return "gpu" if self.platform == "cuda" else self.platform


def _gpu(name: str, num_gpus: int) -> Target:
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 989 TFLOP/s dense
    # BF16 (1979 with sparsity), 80 GB HBM3 at 3.35 TB/s. HBM bytes as the device reports
    # them (XLA's h100_sxm.txtpb device_memory_size).
    topology = {"topology": f"1x1x{num_gpus}", "target_config": H100_SXM_TARGET_CONFIG}
    return Target(name, "cuda", num_gpus, topology, 989e12, 84_978_434_048, 3.35e12)


GIB = 1 << 30
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _gpu("h100", 1),
        _gpu("h100x8", 8),
        # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s per chip.
        Target("v5e:1x1", "tpu", 1, {"chips_per_host_bounds": (1, 1, 1)}, 197e12, 16 * GIB, 819e9),
        Target("v5e:2x2", "tpu", 4, {}, 197e12, 16 * GIB, 819e9),
        # cloud.google.com/tpu/docs/v6e (Trillium): 918 TFLOP/s bf16, 32 GiB HBM at 1640 GB/s.
        Target("v6e:2x2", "tpu", 4, {}, 918e12, 32 * GIB, 1640e9),
        # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s.
        Target("v5p:2x2x1", "tpu", 4, {}, 459e12, 95 * GIB, 2765e9),
        # cloud.google.com/tpu/docs/tpu7x (Ironwood): 2307 TFLOP/s bf16 (4614 fp8),
        # 192 GiB HBM3e at 7.37 TB/s.
        Target("tpu7x:2x2x1", "tpu", 4, {}, 2307e12, 192 * GIB, 7.37e12),
    )
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; valid: {', '.join(TARGETS)}")
    return TARGETS[name]


#: What libtpu reads when it loads (at the first TPU topology): no GCE metadata probe (jax
#: also sets this when it finds no TPU chip), a worker host name (else it logs an error),
#: and no lock file, so that several processes can compile for TPUs at once.
LIBTPU_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


class DoesNotFit(ValueError):
    """The weights and the KV pool (and the step's buffers) exceed a chip's memory."""


@functools.cache
def target_devices(name: str) -> tuple[jax.Device, ...]:
    """The target's compile-only devices (ValueError naming the missing package if its
    compiler is not installed)."""
    from jax.experimental import topologies

    target = get_target(name)
    if target.platform == "tpu":
        for key, value in LIBTPU_ENV.items():
            os.environ.setdefault(key, value)
    kwargs = dict(target.topology)
    extra = "jax[tpu]" if target.platform == "tpu" else "jax[cuda12]"
    topology_name = name if target.platform == "tpu" else ""
    try:
        topology = topologies.get_topology_desc(
            topology_name=topology_name, platform=target.platform, **kwargs
        )
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"cannot compile for {name}: {first} (is {extra} installed, and JAX_PLATFORMS=cpu?)"
        ) from exc
    return tuple(topology.devices)


def memory_limit_bytes(target: Target) -> int:
    """A chip's memory as jax's allocator on it would report it (memory_stats' bytes_limit):
    on GPU XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of it, on TPU all of it."""
    if target.platform != "cuda":
        return target.hbm_bytes
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_MEM_FRACTION))
    return int(target.hbm_bytes * fraction)


def read_model_config(model: str | Path | None) -> dict[str, Any]:
    """A Hugging Face config.json, given as the file or its directory."""
    import json

    if model is None:
        raise ValueError("model: give a model directory or its config.json (--model)")
    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"model: {model} is neither a config.json nor a directory holding one")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"model: {path} is not valid JSON: {exc}") from None


def program_bytes(compiled: jax.stages.Compiled) -> int:
    """Per device, what a compiled step allocates beyond its arguments: temporaries and
    the outputs not aliased to a donated argument (the KV pool is)."""
    mem = compiled.memory_analysis()
    return mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes


@dataclass
class AotBuild:
    """What `compile_for_target` compiled: the runner (its compiled steps) and the facts
    the report needs."""

    target: Target
    config: EngineConfig
    spec: ModelSpec
    runner: ModelRunner
    buckets: tuple[Bucket, ...]
    pool: PoolSizing
    kv_dtype: jnp.dtype
    attention: str
    tensor_parallel_size: int
    params_bytes: int  # per device
    memory_limit_bytes: int  # per device
    probe_seconds: float = 0.0  # the extra compile that measured the step's buffers
    compile_seconds: float = 0.0  # wall time of compiling every bucket


def compile_for_target(
    config: EngineConfig,
    target: Target,
    *,
    hbm_bytes: int | None = None,
    threads: int = 1,
    progress: bool = False,
    log: Any = None,
) -> AotBuild:
    """Compile every bucket of `config` (its model: a config.json) for `target`.

    `hbm_bytes`: a chip's memory instead of the target's (to check what fits a smaller
    part). `threads`: buckets compiled at once (ModelRunner.compile). Any compile error
    propagates; DoesNotFit if the weights and the pool alone exceed a chip. The config's
    compilation_cache is not used (see below), and the persistent cache is left off."""
    log = log or (lambda message: None)
    devices = target_devices(target.name)
    platform = target.device_platform
    spec = registry.spec_from_hf_config(read_model_config(config.model))
    tp = config.parallel.tensor_parallel_size
    if config.parallel.data_parallel_size != 1:
        raise ValueError("data_parallel_size: compile one replica (data_parallel_size=1)")
    if tp > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} chips; {target.name} has {len(devices)}"
        )
    if config.kernels.matmul not in ("auto", "xla"):
        raise ValueError(f"kernels.matmul={config.kernels.matmul!r} is a CPU kernel; use xla")
    mesh = sharding.replica_mesh(tp, devices[:tp])
    dtype = jnp.dtype(config.dtype)
    plan = plan_device(config, spec, platform)
    buckets = plan.buckets
    infos = quantized_infos(registry.param_infos(spec), config.quantization, platform)
    params = abstract_from_infos(infos, dtype)
    params, infos = with_lora_slots(
        config.lora, params, infos, registry.param_infos(spec), spec, dtype
    )
    rules = sharding.rules_for(spec, tp)
    params_bytes = sharding.bytes_per_device(params, sharding.param_shardings(infos, mesh, rules))
    limit = hbm_bytes if hbm_bytes is not None else memory_limit_bytes(target)
    runner_args = dict(plan.runner_args(mesh), abstract=True)

    def runner(num_pages: int) -> ModelRunner:
        return ModelRunner(spec, params, infos, num_pages=num_pages, **runner_args)

    def pool(program: int = 0) -> PoolSizing:
        try:
            sizing = plan.size_pool(
                params_bytes=params_bytes, program_bytes=program, memory_limit_bytes=limit
            )
        except ValueError as exc:  # too little memory left for a max_model_len sequence
            raise DoesNotFit(f"does not fit on {target.name}: {exc}") from None
        need = params_bytes + sizing.num_pages * sizing.page_bytes + program
        if need > limit:
            raise DoesNotFit(
                f"does not fit on {target.name}: weights and KV pool ({sizing.describe()}) "
                f"take {need / 1e9:.2f} GB per chip, more than its {limit / 1e9:.2f} GB"
            )
        return sizing

    # No persistent cache: jax cannot read an entry back without a device client
    # ("PjRtCompiler must be constructed with a Client to call
    # DeserializeLoadedExecutable"), so a second run would compile again anyway, after a
    # warning per bucket. (On a real device the engine's start-up does hit it.)
    compile_cache.configure("off")
    sizing, probe_seconds, probe = pool(), 0.0, None
    if sizing.source == "device memory":
        log(f"sizing the KV pool: compiling the largest bucket with {sizing.num_pages} pages")
        t0 = time.perf_counter()
        probe = runner(sizing.num_pages)
        measured = measure_program_bytes(probe, buckets, threads)
        probe_seconds = time.perf_counter() - t0
        sizing = pool(measured)
    built = runner(sizing.num_pages)
    if probe is not None:  # (its sampling program is the built runner's: not compiled again)
        built.programs.adopt_samplers(probe.programs)
    log(f"KV pool: {sizing.describe()}")
    t0 = time.perf_counter()
    built.compile(buckets, progress=progress, threads=threads)
    seconds = time.perf_counter() - t0
    return AotBuild(
        target=target,
        config=config,
        spec=spec,
        runner=built,
        buckets=buckets,
        pool=sizing,
        kv_dtype=plan.kv_dtype,
        attention=plan.attention.name,
        tensor_parallel_size=tp,
        params_bytes=per_device_bytes(built.params),
        memory_limit_bytes=limit,
        probe_seconds=probe_seconds,
        compile_seconds=seconds,
    )


def measure_program_bytes(
    runner: ModelRunner, buckets: tuple[Bucket, ...], threads: int = DEFAULT_COMPILE_THREADS
) -> int:
    """`program_bytes` of the largest bucket (most tokens, then most sequences) or of its
    sampling program, whichever is more, compiled on `runner` (an abstract one: no memory
    taken), the two side by side with `threads`."""
    largest = max(buckets, key=lambda b: (b.num_tokens, b.num_seqs))
    runner.compile((largest,), threads=threads)
    return max(
        program_bytes(runner.programs.compiled_step(largest)),
        program_bytes(runner.programs.compiled_sampler(largest.num_seqs)),
    )


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded (abstract) arrays: its shards."""
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, tree)
    return sharding.bytes_per_device(tree, shardings)
