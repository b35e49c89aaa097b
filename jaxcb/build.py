"""The engine factory: an EngineConfig to a ready engine, above both sides.

`build_engine(config)` is what `LLM`, the server, batch inference and perplexity call. It
sets up jax.distributed if asked, has runtime/setup.py build the device side (the runner
and what it is; a second one for a speculative draft model) and hands the host-side
`LLMEngine` the runner, the model's tokenizer and EOS ids and the EngineInfo. With
data_parallel_size > 1 it builds one such engine per row of the (data, tensor) mesh and puts
them behind a `ReplicatedEngine`. It sits above runtime/ and
engine/ so that neither imports the other's classes: runtime/ builds no engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax

from jaxcb.config import EngineConfig
from jaxcb.engine.interface import Engine, EngineInfo
from jaxcb.engine.llm_engine import LLMEngine
from jaxcb.engine.replicated import ReplicatedEngine
from jaxcb.engine.sched.factory import check_scheduler_config
from jaxcb.engine.spec import DraftModel
from jaxcb.runtime import distributed, sharding
from jaxcb.runtime.setup import build_runner

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig | None = None, *, compile_progress: bool = False) -> Engine:
    """One LLMEngine, or `data_parallel_size` replicas behind the same interface."""
    config = config or EngineConfig()
    check_scheduler_config(config)  # before the minutes of loading and compiling
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
    draft = None
    if config.speculative_config.method == "draft_model":
        draft = build_draft_model(config, info, devices=devices, compile_progress=compile_progress)
    return LLMEngine(
        config,
        runner=runner,
        info=info,
        tokenizer=model.tokenizer,
        eos_token_ids=model.eos_token_ids,
        draft=draft,
    )


def build_draft_model(
    config: EngineConfig,
    target: EngineInfo,
    *,
    devices: Sequence[jax.Device] | None = None,
    compile_progress: bool = False,
) -> DraftModel:
    """The draft model of speculative_config's "draft_model": its checkpoint (`model`, or
    the target's own) loaded with its `quantization`, on the target's devices, with a KV
    pool of as many pages as the target's (a draft never holds more tokens than the target
    plus its guesses) and the target's buckets, compiled like the target's."""
    spec = config.speculative_config
    draft_config = config.replace(
        model=spec.model or config.model,
        quantization=spec.quantization or "none",
        max_model_len=target.max_model_len,
        speculative_config={"method": "none", "model": None, "quantization": None},
        num_pages=target.num_pages,
        kv_cache_memory_gb=None,
        enable_prefix_caching=False,
        swap_space_gb=0.0,
        preemption_mode="recompute",
    )
    runner, info, _ = build_runner(draft_config, devices=devices, compile_progress=compile_progress)
    if info.vocab_size != target.vocab_size:
        runner.close()
        raise ValueError(
            f"the draft model's vocabulary ({info.vocab_size} tokens) is not the target's "
            f"({target.vocab_size}): a draft must share the target's tokenizer"
        )
    logger.info(
        "draft model %s (%s, quantization %s): %.1f MB of weights, %d KV pages",
        info.model_path,
        info.architecture,
        info.quantization,
        info.weight_bytes / 1e6,
        info.num_pages,
    )
    return DraftModel(
        runner=runner, buckets=info.buckets, page_size=info.page_size, num_pages=info.num_pages
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
