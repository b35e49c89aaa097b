"""Device state: the KV page pool (layout from pallas_kernels).

Also decides how many pages the pool gets: `num_pages`, or a memory budget, or (auto) enough
for `max_num_seqs` full-length sequences within what the device can spare. With tensor
parallelism each device holds 1/N of every page (the pool is sharded by KV head), so auto
sizing weighs a device's spare memory against its share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxcb.config import CacheConfig
from jaxcb.models.base import KVCache, ModelSpec
from pallas_kernels.ragged_paged_attention import kv_pages_bytes, kv_pages_shape, pages_per_seq

logger = logging.getLogger(__name__)

GIB = 1 << 30
CPU_AUTO_BUDGET_BYTES = 4 * GIB  # auto sizing on CPU never takes more than this


@dataclass
class DeviceState:
    kv_caches: KVCache  # per layer (k_pages, v_pages), each [Hkv, P, page_size, D]


jax.tree_util.register_dataclass(DeviceState, data_fields=["kv_caches"], meta_fields=[])


def resolve_kv_cache_dtype(name: str, model_dtype: jnp.dtype, attention: str) -> jnp.dtype:
    """ "auto": the model's dtype, except float32 with the "xla" backend on CPU.

    XLA's CPU backend cannot update a bfloat16 buffer in place with a scatter: every KV write
    copies the whole layer's pool (17 ms per write for a 2112-page pool, against 0.01 ms in
    float32). The native CPU backend writes pages in place in any dtype.
    """
    if name != "auto":
        return jnp.dtype(name)
    if attention == "xla" and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(model_dtype)


def page_bytes(spec: ModelSpec, page_size: int, itemsize: int) -> int:
    """Bytes one page takes across all layers (K and V)."""
    return spec.num_layers * kv_pages_bytes(
        1, page_size, spec.num_kv_heads, spec.head_dim, itemsize
    )


def resolve_num_pages(
    cache: CacheConfig,
    spec: ModelSpec,
    *,
    itemsize: int,
    max_model_len: int,
    max_num_seqs: int,
    params_bytes: int = 0,
    tensor_parallel_size: int = 1,
    device: jax.Device | None = None,
) -> int:
    """Pages in the pool; `params_bytes`: weights not yet on the devices when this is called
    (all of them: each of the `tensor_parallel_size` devices holds its share)."""
    per_page = page_bytes(spec, cache.page_size, itemsize)
    min_pages = pages_per_seq(max_model_len, cache.page_size)
    if cache.num_pages is not None:
        num_pages = cache.num_pages
    elif cache.kv_cache_memory_gb is not None:
        num_pages = int(cache.kv_cache_memory_gb * GIB // per_page)
    else:
        wanted = max_num_seqs * min_pages
        tp = tensor_parallel_size
        spare = _spare_device_bytes(cache.memory_utilization, device) - params_bytes // tp
        num_pages = min(wanted, max(0, spare) // -(-per_page // tp))
    if num_pages < min_pages:
        raise ValueError(
            f"the KV pool has {num_pages} pages of {cache.page_size} tokens "
            f"({num_pages * cache.page_size} tokens), fewer than max_model_len={max_model_len} "
            f"needs ({min_pages} pages); raise num_pages / kv_cache_memory_gb or lower "
            "max_model_len"
        )
    return num_pages


def _spare_device_bytes(utilization: float, device: jax.Device | None = None) -> int:
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return CPU_AUTO_BUDGET_BYTES
    free = stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
    return max(0, int(free))


def init_state(
    spec: ModelSpec,
    *,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> DeviceState:
    """Zeroed K and V pages per layer, created in place on their devices (`sharding`: by KV
    head for tensor parallelism; None: the default device)."""
    shape = kv_pages_shape(num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    caches = [(zeros(), zeros()) for _ in range(spec.num_layers)]
    return DeviceState(caches)
