"""The device side of one engine, from an EngineConfig: what jaxcb/build.py's factory
hands each LLMEngine.

`build_runner(config)` decides everything device-side once, in order: the mesh (one device,
or tensor_parallel_size devices), the model (spec, params, tokenizer, EOS ids), the device
plan (runtime/plan.py: attention backend, KV dtype, buckets), the matmul backend, the KV
pool's page count, the runner with its compiled step per bucket and sampling program per
sequence-row count (through the persistent compilation cache) and, for preemption by swap,
its host swap pool (compiled copies, the device-host bandwidth measured); it returns the
runner, an EngineInfo of the facts above and the loaded model (tokenizer, EOS ids).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb import native
from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket
from jaxcb.engine.interface import EngineInfo
from jaxcb.lora import with_lora_slots
from jaxcb.models import registry
from jaxcb.models.base import abstract_from_infos
from jaxcb.models.cpu_params import matmul_backend, matmul_report
from jaxcb.models.loading.default_model import DEFAULT_NAME
from jaxcb.models.loading.loader import LoadedModel, load_model
from jaxcb.models.quant import (
    check_stored,
    check_tensor_parallel,
    is_quantized,
    quantize_params,
    quantized_head_infos,
    quantized_infos,
    weight_bytes,
)
from jaxcb.runtime import aot, compile_cache, sharding
from jaxcb.runtime.kv_cache import PoolSizing, kv_bytes_per_token, page_bytes
from jaxcb.runtime.kv_swap import num_swap_pages
from jaxcb.runtime.plan import DevicePlan, plan_device
from jaxcb.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)


def build_runner(
    config: EngineConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    compile_progress: bool = False,
) -> tuple[ModelRunner, EngineInfo, LoadedModel]:
    """The device side of one engine, compiled for every bucket, and what it is."""
    t0 = time.perf_counter()
    dtype = jnp.dtype(config.dtype)
    mesh = sharding.engine_mesh(config.parallel, devices)
    model = load_model(
        config.model,
        tokenizer_path=config.tokenizer,
        dtype=dtype,
        shardings=lambda spec: sharding.model_param_shardings(spec, mesh=mesh),
        quantization=config.quantization,
    )
    load_seconds = time.perf_counter() - t0
    spec, cache, sched = model.spec, config.cache, config.scheduler
    config = _stored_quantization(config, model.quantization)
    plan = plan_device(config, spec, jax.default_backend())
    check_stored(model.quantization, jax.default_backend())
    params, infos = quantize_params(
        model.params,
        registry.param_infos(spec),
        "none" if model.quantization != "none" else config.quantization,
        grids=model.block_grids,
        platform=jax.default_backend(),
    )
    infos = quantized_infos(infos, model.quantization)
    # The head as the params hold it: quantized (GGUF blocks, a tied table), or none at all
    # (a tied table in an int8 checkpoint converted before tables were quantized as heads).
    if "lm_head" not in params:
        infos = {k: v for k, v in infos.items() if k != "lm_head"}
    elif is_quantized(params["lm_head"]) and not is_quantized(infos.get("lm_head")):
        infos = quantized_head_infos(infos, model.quantization)
    params, infos = with_lora_slots(
        config.lora, params, infos, registry.param_infos(spec), spec, dtype
    )  # (jaxcb/lora.py)
    tp = sharding.tensor_parallel_size(mesh)
    check_tensor_parallel(infos, sharding.rules_for(spec, tp), tp)
    matmul = _matmul_backend(config, dtype, sharding.tensor_parallel_size(mesh))
    cpu_kernels = _cpu_kernels(config, matmul, dtype, sharding.tensor_parallel_size(mesh))
    kv_dtype, buckets, max_model_len = plan.kv_dtype, plan.buckets, plan.max_model_len
    runner_args = plan.runner_args(mesh)
    pool, probe = _size_pool(plan, params, infos, runner_args)
    num_pages = pool.num_pages
    swap_pages = 0
    swapping = sched.preemption_mode != "recompute" and sched.batching == "continuous"
    if swapping:
        swap_pages = num_swap_pages(
            cache.swap_space_gb, page_bytes(spec, cache.page_size, kv_dtype)
        )
    runner = ModelRunner(
        spec,
        params,
        infos,
        num_pages=num_pages,
        pack_matmuls=None if matmul == "xla" else matmul,
        greedy_screen=config.kernels.greedy_screen,
        num_swap_pages=swap_pages,
        **runner_args,
    )
    if probe is not None:  # (the probe's sampling program is this runner's: not compiled again)
        runner.programs.adopt_samplers(probe.programs)
    compile_seconds, cache_figures = _compile(runner, buckets, config, compile_progress)
    compile_seconds += runner.compile_swap()
    swap_bytes_per_s = runner.measure_swap_bandwidth()
    if swapping and swap_pages == 0:
        logger.warning(
            "swap_space_gb=%s holds no KV page (%d bytes each): every preemption recomputes",
            cache.swap_space_gb,
            page_bytes(spec, cache.page_size, kv_dtype),
        )
    elif swapping:
        logger.info(
            "preemption by %s: %d host KV pages (swap_space_gb=%s), device-host %.2f GB/s",
            sched.preemption_mode,
            swap_pages,
            cache.swap_space_gb,
            swap_bytes_per_s / 1e9,
        )
    info = EngineInfo(
        model_path=str(model.path),
        model_name=model_name(config),
        model_format=model.format,
        random_weights=model.random_weights,
        architecture=spec.architecture,
        vocab_size=spec.vocab_size,
        max_model_len=max_model_len,
        buckets=buckets,
        page_size=cache.page_size,
        num_pages=num_pages,
        kv_cache_bytes=num_pages * page_bytes(spec, cache.page_size, kv_dtype),
        quantization=config.quantization,
        weight_bytes=weight_bytes(runner.params),
        kv_pool_sizing=pool.describe(),
        kv_cache_dtype=str(kv_dtype),
        kv_bytes_per_token=kv_bytes_per_token(spec, kv_dtype),
        attention_backend=plan.attention.name,
        matmul_backend=matmul,
        platform=jax.default_backend(),
        load_seconds=load_seconds,
        compile_seconds=compile_seconds,
        # (the runner's own dict: it grows while a background compile goes on)
        compile_seconds_per_bucket=runner.programs.compile_seconds,
        compile_cache=cache_figures,
        cpu_kernels=cpu_kernels,
        num_swap_pages=swap_pages,
        swap_bytes_per_s=swap_bytes_per_s,
        max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        max_lora_rank=config.lora.max_lora_rank if config.lora.enable_lora else 0,
    )
    _log_ready(info, config)
    logger.info("KV pool: %s", pool.describe())
    return runner, info, model


def _stored_quantization(config: EngineConfig, stored: str) -> EngineConfig:
    """The config with the quantization a checkpoint's weights are stored in ("none": as
    configured); another quantization asked for is a one-line ValueError."""
    if stored == "none" or config.quantization == stored:
        return config
    if config.quantization != "none":
        raise ValueError(
            f"quantization={config.quantization!r}, but {config.model} stores {stored} "
            "weights: leave quantization unset (none) or convert the checkpoint again"
        )
    return dataclasses.replace(config, quantization=stored)


def _matmul_backend(config: EngineConfig, dtype: Any, tensor_parallel_size: int) -> str:
    """cpu_params.matmul_backend's choice for the model dtype's matmuls (quantized weights go to
    the native int8 kernel wherever a native kernel is chosen and it runs, else to XLA);
    fp8 on a named native CPU kernel is a one-line ValueError."""
    requested = config.kernels.matmul
    if config.quantization == "fp8" and jax.default_backend() == "cpu":
        if requested not in ("auto", "xla"):
            raise ValueError(
                f"quantization='fp8' has no native CPU kernel (kernels.matmul={requested!r}): "
                "on CPU use quantization int8, or kernels.matmul auto / xla to test fp8"
            )
        logger.warning(
            "quantization='fp8' on CPU: XLA converts the fp8 weights in every step (slow, "
            "for tests); quantization int8 runs on the native kernels"
        )
    return matmul_backend(requested, dtype=dtype, tensor_parallel_size=tensor_parallel_size)


def _cpu_kernels(
    config: EngineConfig, matmul: str, dtype: Any, tensor_parallel_size: int
) -> dict[str, Any]:
    """What the engine's info and stats() say of the native CPU kernels (empty off CPU)."""
    if jax.default_backend() != "cpu":
        return {}
    return {
        "cpu": native.cpu_summary(),
        "isa_level": native.active_level(),
        "isa_cap": native.build.isa_cap(),
        "matmul_kernels": matmul_report(
            matmul,
            requested=config.kernels.matmul,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            quantization=config.quantization,
        ),
        "tile_shapes": _avx2_tile_shapes(config, matmul),
    }


def _avx2_tile_shapes(config: EngineConfig, matmul: str) -> dict[str, str]:
    """The AVX2 tile shape this CPU's probe picked for many-row products, per weight form
    (native.tile_shapes), where a kernel in use runs from the avx2 library (the matmul
    kernel's, or the int8 one's for quantized weights); else empty (AVX-512 tiles have one
    shape)."""
    in_use = [native.ALL_PACKED[matmul]] if matmul in native.ALL_PACKED else []
    if config.quantization != "none" and in_use:
        in_use.append(native.INT8_MATMUL)
    if any(spec.library_level() == "avx2" for spec in in_use):
        return native.tile_shapes("avx2")
    return {}


def model_name(config: EngineConfig) -> str:
    """The model as the user named it: the path, name or hub id given, else the default's."""
    return config.model or DEFAULT_NAME


def _size_pool(
    plan: DevicePlan, params: Any, infos: Any, runner_args: dict[str, Any]
) -> tuple[PoolSizing, ModelRunner | None]:
    """The KV pool's page count (DevicePlan.size_pool) and how it was found, and the
    abstract runner that measured the compiled step (None: none did).

    Sized from an accelerator's memory (auto sizing), the pool leaves room for the compiled
    step's own buffers: the largest bucket is compiled once beforehand on an abstract runner
    (no memory taken; runtime/aot.py) with the pool sized without them, and its temporaries
    and fresh outputs are measured. That is one step compile more at start-up (a cache hit on
    later starts; its sampling program is the runner's, not compiled again); with num_pages or
    kv_cache_memory_gb given, or on CPU, there is none."""
    mesh = runner_args["mesh"]
    shardings = sharding.param_shardings(
        infos, mesh, sharding.rules_for(plan.spec, sharding.tensor_parallel_size(mesh))
    )
    # (weights an orbax restore already put on the devices count as memory in use)
    to_place = sharding.bytes_per_device(params, shardings, skip=lambda x: isinstance(x, jax.Array))
    memory = dict(params_bytes=to_place, device=mesh.devices.flat[0])
    pool = plan.size_pool(**memory)
    if pool.source != "device memory":
        return pool, None
    compile_cache.configure(plan.config.compilation_cache)
    params = abstract_from_infos(infos, jnp.dtype(plan.config.dtype))
    probe = ModelRunner(
        plan.spec, params, infos, num_pages=pool.num_pages, abstract=True, **runner_args
    )
    measured = aot.measure_program_bytes(probe, plan.buckets)
    return plan.size_pool(program_bytes=measured, **memory), probe


def _compile(
    runner: ModelRunner, buckets: tuple[Bucket, ...], config: EngineConfig, progress: bool
) -> tuple[float, dict[str, Any]]:
    """Compile every bucket through the persistent cache; (seconds, what the cache gave).
    On accelerators several buckets compile at once (aot.DEFAULT_COMPILE_THREADS: the host
    compiles a GPU or TPU program, and XLA releases the GIL); CPU compiles one at a time.
    With compile_in_background, only the smallest bucket compiles here and the others on the
    runner's background thread (what the cache gives them is not counted)."""
    cache_path = compile_cache.configure(config.compilation_cache)
    entries_before = compile_cache.count_step_entries(cache_path)
    on_cpu = runner.mesh.devices.flat[0].platform == "cpu"
    threads = 1 if on_cpu else aot.DEFAULT_COMPILE_THREADS
    now = 1 if config.compile_in_background else len(buckets)
    seconds = runner.compile(buckets, progress=progress, threads=threads, ready_after=now)
    fresh = compile_cache.count_step_entries(cache_path) - entries_before
    return seconds, {
        "dir": str(cache_path) if cache_path else None,
        "buckets_compiled": fresh if cache_path else now,
        "buckets_from_cache": now - fresh if cache_path else 0,
        "buckets_in_background": len(buckets) - now,
    }


def _log_ready(info: EngineInfo, config: EngineConfig) -> None:
    logger.info(
        "engine ready: %s (%s%s), dtype %s%s, weights %.1f MiB, %d %s KV pages x %d tokens "
        "(%.1f MiB, %d bytes a token), buckets %s, attention %s, matmul %s, on %s, "
        "load %.1fs, compile %.1fs (%d of %d buckets from the compilation cache%s)",
        info.model_path,
        info.architecture,
        ", RANDOM WEIGHTS" if info.random_weights else "",
        config.dtype,
        f", {info.quantization} weights" if info.quantization != "none" else "",
        info.weight_bytes / 2**20,
        info.num_pages,
        info.kv_cache_dtype,
        info.page_size,
        info.kv_cache_bytes / 2**20,
        info.kv_bytes_per_token,
        info.token_buckets,
        info.attention_backend,
        info.matmul_backend,
        info.platform,
        info.load_seconds,
        info.compile_seconds,
        info.compile_cache["buckets_from_cache"],
        len(info.buckets),
        f", {info.compile_cache['buckets_in_background']} compiling in the background"
        if info.compile_cache.get("buckets_in_background")
        else "",
    )
    if info.cpu_kernels:
        others = "; ".join(
            f"{k}: {why}"
            for k, why in info.cpu_kernels["matmul_kernels"].items()
            if why != "in use"
        )
        tiles = info.cpu_kernels.get("tile_shapes") or {}
        logger.info(
            "CPU kernels: %s, ISA level %s; matmul %s%s (not picked: %s)",
            info.cpu_kernels["cpu"],
            info.cpu_kernels["isa_level"],
            info.matmul_backend,
            ", AVX2 tiles of many rows: " + ", ".join(f"{f} {s}" for f, s in tiles.items())
            if tiles
            else "",
            others,
        )
