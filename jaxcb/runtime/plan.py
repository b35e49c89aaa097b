"""The device plan: what a config decides for a model on a platform, decided in one place.

Both composition roots read it: `setup.py` (an engine on the devices present) and `aot.py`
(compiling every bucket for an absent TPU or GPU target), so the programs the AOT compile
proves are the ones a server on that target would run: the same max_model_len check, the
same attention backend and KV dtype, the same buckets, the same runner arguments and the
same KV pool sizing rule. Nothing here reads weights or touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.attention import check_kv_cache_dtype, get_attention_backend
from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket, default_token_buckets, make_buckets
from jaxcb.engine.interface import MAX_TOP_LOGPROBS
from jaxcb.models.base import AttentionBackend, ModelSpec
from jaxcb.runtime.kv_cache import PoolSizing, resolve_kv_cache_dtype, size_kv_pool
from pallas_kernels.ragged_paged_attention import pages_per_seq


@dataclass(frozen=True)
class DevicePlan:
    config: EngineConfig
    spec: ModelSpec
    platform: str  # "cpu", "gpu" or "tpu": the devices the programs are for
    max_model_len: int
    attention: AttentionBackend
    kv_dtype: jnp.dtype
    buckets: tuple[Bucket, ...]
    scan_layers: bool  # the layers as a lax.scan (models/stacking.py), else unrolled

    @property
    def pages_per_seq(self) -> int:
        return pages_per_seq(self.max_model_len, self.config.cache.page_size)

    def runner_args(self, mesh: jax.sharding.Mesh) -> dict[str, Any]:
        """ModelRunner's keyword arguments besides the params and the page count."""
        return dict(
            kv_cache_dtype=self.kv_dtype,
            page_size=self.config.cache.page_size,
            pages_per_seq=self.pages_per_seq,
            max_model_len=self.max_model_len,
            attention=self.attention,
            num_top_logprobs=MAX_TOP_LOGPROBS,
            scan_layers=self.scan_layers,
            mesh=mesh,
        )

    def size_pool(self, *, params_bytes: int, program_bytes: int = 0, **memory: Any) -> PoolSizing:
        """The KV pool (kv_cache.size_kv_pool) for weights of `params_bytes` a device and a
        compiled step's own buffers of `program_bytes`; `memory`: the device to read the
        memory of, or a memory_limit_bytes for a target that is not present."""
        return size_kv_pool(
            self.config.cache,
            self.spec,
            dtype=self.kv_dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            params_bytes=params_bytes,
            tensor_parallel_size=self.config.parallel.tensor_parallel_size,
            program_bytes=program_bytes,
            **memory,
        )


def plan_device(config: EngineConfig, spec: ModelSpec, platform: str) -> DevicePlan:
    """The plan for `config`'s model (`spec`) on `platform`; a one-line ValueError for a
    max_model_len past the model's, or a KV dtype the attention backend cannot read."""
    sched = config.scheduler
    max_model_len = resolve_max_model_len(config, spec)
    attention = get_attention_backend(config.kernels.attention, platform)
    kv_dtype = _kv_dtype(config, attention, platform)
    token_buckets = sched.token_buckets or default_token_buckets(
        sched.max_num_batched_tokens, smallest=smallest_token_bucket(platform)
    )
    buckets = make_buckets(token_buckets, config.max_num_sample_rows, sched.seq_buckets)
    scan = config.kernels.scan_layers
    if scan is None:  # (LoRA's slot arrays are read per layer of the scan: scanned then)
        scan = scan_layers_default(platform) or config.lora.enable_lora
    return DevicePlan(config, spec, platform, max_model_len, attention, kv_dtype, buckets, scan)


def scan_layers_default(platform: str) -> bool:
    """kernels.scan_layers when the config leaves it unset: scanned on CPU and TPU, unrolled
    on GPU, by measurement. On CPU the scan compiles a bucket's step in ~0.45 s instead of
    ~0.7 (SmolLM2) at the same step time. For a v5e x4 (Qwen3-8B preset) the scanned step
    moves the unrolled one's HBM bytes (3.79 against 3.84 GB besides the attention kernel at
    (64, 16); each layer's matmuls read their slice of the stack in place, the KV write
    scatters into the carried pool in place) and its buckets compile in 73.5 s + 15.5 s
    sizing on a 2-core host. Compiled for an H100, the scan's per-layer slices of the
    stacked weights are copies (XLA's GPU backend fuses no dynamic slice into its gemms:
    46.3 GB a step against 18.6 unrolled, Llama-3-8B at (64, 16)), so GPUs keep the
    unrolled layers (docs/architecture.md, "Stacked layers and the scan")."""
    return platform in ("cpu", "tpu")


def _kv_dtype(config: EngineConfig, attention: AttentionBackend, platform: str) -> jnp.dtype:
    requested = config.cache.kv_cache_dtype
    kv_dtype = resolve_kv_cache_dtype(requested, jnp.dtype(config.dtype), attention.name, platform)
    check_kv_cache_dtype(attention.name, kv_dtype, requested, platform)
    return kv_dtype


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """max_model_len from the config, else the model's max_position_embeddings."""
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model's "
            f"max_position_embeddings={spec.max_position_embeddings}"
        )
    return max_model_len


def smallest_token_bucket(platform: str) -> int:
    """The default buckets' smallest size: on CPU 1 (powers of two from one token), on
    accelerators 16 (a few padding rows cost them nothing). On CPU a bucket's padding rows
    cost time on every path: XLA's dots compute them (SmolLM2 float32, one request: 33.4 ->
    19.2 ms per token), and where the native matmuls skip them, the LM head's [S, V] logits,
    their zeroed padding rows and the sampling passes over them remain (SmolLM2 int8, one
    request: 10.3 -> 7.9 ms per token in a (1, 1) bucket than in a (16, 16) one), for four
    more compiles (1, 2, 4, 8)."""
    return 1 if platform == "cpu" else 16
