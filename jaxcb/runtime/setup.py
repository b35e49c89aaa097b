"""The composition root: from an EngineConfig to a ready engine.

`build_engine(config)` is what `LLM`, the server and batch inference call. It decides
everything device-side once, in order: the mesh (one device, or tensor_parallel_size devices;
jax.distributed first if asked), the model (spec, params, tokenizer, EOS ids), the attention
and matmul backends, the KV dtype and page count, the buckets, the runner with its compiled
step per bucket (through the persistent compilation cache) and, for preemption by swap, its
host swap pool (compiled copies, the device-host bandwidth measured), and then hands the host-side
`LLMEngine` what it needs: the runner, the model's tokenizer and EOS ids, and an EngineInfo
of the facts above. With data_parallel_size > 1 it builds one such engine per row of the
(data, tensor) mesh and puts them behind a `ReplicatedEngine`.
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
from jaxcb.attention import check_kv_cache_dtype, get_attention_backend
from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket, default_token_buckets, make_buckets
from jaxcb.engine.interface import MAX_TOP_LOGPROBS, Engine, EngineInfo
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.engine.replicated import ReplicatedEngine
from jaxcb.models import registry
from jaxcb.models.base import ModelSpec, abstract_from_infos
from jaxcb.models.default_model import DEFAULT_NAME
from jaxcb.models.loader import LoadedModel, load_model
from jaxcb.models.packed import matmul_backend, matmul_report
from jaxcb.models.quant import (
    check_stored,
    check_tensor_parallel,
    is_quantized,
    quantize_params,
    quantized_head_infos,
    quantized_infos,
    weight_bytes,
)
from jaxcb.runtime import aot, compile_cache, distributed, sharding
from jaxcb.runtime.kv_cache import (
    PoolSizing,
    kv_bytes_per_token,
    page_bytes,
    resolve_kv_cache_dtype,
    size_kv_pool,
)
from jaxcb.runtime.kv_swap import num_swap_pages
from jaxcb.runtime.runner import ModelRunner
from pallas_kernels.ragged_paged_attention import pages_per_seq

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig | None = None, *, compile_progress: bool = False) -> Engine:
    """One LLMEngine, or `data_parallel_size` replicas behind the same interface."""
    config = config or EngineConfig()
    if config.parallel.data_parallel_size == 1:
        return build_llm_engine(config, compile_progress=compile_progress)
    return build_replicated_engine(config, compile_progress=compile_progress)


def build_llm_engine(
    config: EngineConfig,
    *,
    compile_progress: bool = False,
    devices: Sequence[jax.Device] | None = None,  # this replica's devices
) -> LLMEngine:
    """One engine on `devices` (default: the first tensor_parallel_size devices)."""
    sharding.setup_distributed(config.parallel)
    config = distributed.multi_controller_config(config)
    runner, info, model = build_runner(config, devices=devices, compile_progress=compile_progress)
    return LLMEngine(
        config,
        runner=runner,
        info=info,
        tokenizer=model.tokenizer,
        eos_token_ids=model.eos_token_ids,
    )


def build_replicated_engine(
    config: EngineConfig, *, compile_progress: bool = False
) -> ReplicatedEngine:
    """`data_parallel_size` engines, each on its own row of the (data, tensor) mesh."""
    parallel = config.parallel
    sharding.setup_distributed(parallel)
    if jax.process_count() > 1:
        raise ValueError(
            f"data_parallel_size={parallel.data_parallel_size} over "
            f"{jax.process_count()} processes: replicas are driven by one process; run one "
            "job per host with data_parallel_size counting that host's replicas"
        )
    mesh = sharding.device_mesh(parallel.data_parallel_size, parallel.tensor_parallel_size)
    replicas = []
    for i, replica_mesh in enumerate(sharding.replica_meshes(mesh)):
        devices = list(replica_mesh.devices.flat)
        # Distinct seeds: unseeded requests on two replicas must not draw alike.
        replica_config = config.replace(seed=config.seed + i)
        replicas.append(
            build_llm_engine(replica_config, compile_progress=compile_progress, devices=devices)
        )
        logger.info("data-parallel replica %d on %s", i, devices)
    return ReplicatedEngine(config, replicas)


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
    max_model_len = resolve_max_model_len(config, spec)
    attention = get_attention_backend(config.kernels.attention)
    config = _stored_quantization(config, model.quantization)
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
    tp = sharding.tensor_parallel_size(mesh)
    check_tensor_parallel(infos, sharding.rules_for(spec, tp), tp)
    matmul = _matmul_backend(config, dtype, sharding.tensor_parallel_size(mesh))
    cpu_kernels = _cpu_kernels(config, matmul, dtype, sharding.tensor_parallel_size(mesh))
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype, attention.name)
    check_kv_cache_dtype(attention.name, kv_dtype, cache.kv_cache_dtype)
    token_buckets = sched.token_buckets or default_token_buckets(
        sched.max_num_batched_tokens, smallest=smallest_token_bucket()
    )
    buckets = make_buckets(token_buckets, sched.max_num_seqs, sched.seq_buckets)
    runner_args = dict(
        kv_cache_dtype=kv_dtype,
        page_size=cache.page_size,
        pages_per_seq=pages_per_seq(max_model_len, cache.page_size),
        max_model_len=max_model_len,
        attention=attention,
        num_top_logprobs=MAX_TOP_LOGPROBS,
        mesh=mesh,
    )
    pool = _size_pool(config, model, infos, max_model_len, buckets, runner_args)
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
        attention_backend=attention.name,
        matmul_backend=matmul,
        platform=jax.default_backend(),
        load_seconds=load_seconds,
        compile_seconds=compile_seconds,
        compile_seconds_per_bucket=dict(runner.compile_seconds),
        compile_cache=cache_figures,
        cpu_kernels=cpu_kernels,
        num_swap_pages=swap_pages,
        swap_bytes_per_s=swap_bytes_per_s,
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
    """packed.matmul_backend's choice for the model dtype's matmuls (quantized weights go to
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


def smallest_token_bucket() -> int:
    """The default buckets' smallest size: on CPU 1 (powers of two from one token), on
    accelerators 16 (a few padding rows cost them nothing). On CPU a bucket's padding rows
    cost time on every path: XLA's dots compute them (SmolLM2 float32, one request: 33.4 ->
    19.2 ms per token), and where the native matmuls skip them, the LM head's [S, V] logits,
    their zeroed padding rows and the sampling passes over them remain (SmolLM2 int8, one
    request: 10.3 -> 7.9 ms per token in a (1, 1) bucket than in a (16, 16) one), for four
    more compiles (1, 2, 4, 8)."""
    return 1 if jax.default_backend() == "cpu" else 16


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


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """max_model_len from the config, else the model's max_position_embeddings."""
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model's "
            f"max_position_embeddings={spec.max_position_embeddings}"
        )
    return max_model_len


def _size_pool(
    config: EngineConfig,
    model: LoadedModel,
    infos: Any,
    max_model_len: int,
    buckets: tuple[Bucket, ...],
    runner_args: dict[str, Any],
) -> PoolSizing:
    """The KV pool's page count (kv_cache.size_kv_pool) and how it was found.

    Sized from an accelerator's memory (auto sizing), the pool leaves room for the compiled
    step's own buffers: the largest bucket is compiled once beforehand on an abstract runner
    (no memory taken; runtime/aot.py) with the pool sized without them, and its temporaries
    and fresh outputs are measured. That is one compile more at start-up (a cache hit on
    later starts); with num_pages or kv_cache_memory_gb given, or on CPU, there is none."""
    spec, cache = model.spec, config.cache

    def size(program_bytes: int = 0) -> PoolSizing:
        return size_kv_pool(
            cache,
            spec,
            dtype=runner_args["kv_cache_dtype"],
            max_model_len=max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            params_bytes=_host_bytes(model.params),
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            device=runner_args["mesh"].devices.flat[0],
            program_bytes=program_bytes,
        )

    pool = size()
    if pool.source != "device memory":
        return pool
    compile_cache.configure(config.compilation_cache)
    params = abstract_from_infos(infos, jnp.dtype(config.dtype))
    probe = ModelRunner(
        spec,
        params,
        infos,
        num_pages=pool.num_pages,
        abstract=True,
        **runner_args,
    )
    return size(aot.measure_program_bytes(probe, buckets))


def _host_bytes(params: Any) -> int:
    """Bytes of the weights not yet on the devices (an orbax restore puts them there)."""
    leaves = jax.tree_util.tree_leaves(params)
    return sum(x.nbytes for x in leaves if not isinstance(x, jax.Array))


def _compile(
    runner: ModelRunner, buckets: tuple[Bucket, ...], config: EngineConfig, progress: bool
) -> tuple[float, dict[str, Any]]:
    """Compile every bucket through the persistent cache; (seconds, what the cache gave).
    On accelerators several buckets compile at once (aot.DEFAULT_COMPILE_THREADS: the host
    compiles a GPU or TPU program, and XLA releases the GIL); CPU compiles one at a time."""
    cache_path = compile_cache.configure(config.compilation_cache)
    entries_before = compile_cache.count_step_entries(cache_path)
    on_cpu = runner.mesh.devices.flat[0].platform == "cpu"
    threads = 1 if on_cpu else aot.DEFAULT_COMPILE_THREADS
    seconds = runner.compile(buckets, progress=progress, threads=threads)
    fresh = compile_cache.count_step_entries(cache_path) - entries_before
    return seconds, {
        "dir": str(cache_path) if cache_path else None,
        "buckets_compiled": fresh if cache_path else len(buckets),
        "buckets_from_cache": len(buckets) - fresh if cache_path else 0,
    }


def _log_ready(info: EngineInfo, config: EngineConfig) -> None:
    logger.info(
        "engine ready: %s (%s%s), dtype %s%s, weights %.1f MiB, %d %s KV pages x %d tokens "
        "(%.1f MiB, %d bytes a token), buckets %s, attention %s, matmul %s, on %s, "
        "load %.1fs, compile %.1fs (%d of %d buckets from the compilation cache)",
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
