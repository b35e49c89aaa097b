"""Device state: the KV page pool (layout from pallas_kernels); the host memory pages go to
when their request is preempted by swap is kv_swap.py.

Pages hold float32 or bfloat16 values, or quantized codes (int8, float8_e4m3fn,
float8_e5m2; pallas_kernels/ragged_paged_attention/kv_quant.py) with a float32 scale per
(KV head, page, slot): one per token and head, written once with the token, so a page that
fills never needs re-scaling and one outlier token does not coarsen the others of its page.
A quantized layer's cache is (k_pages, v_pages, k_scales, v_scales); the scales go wherever
their pages go (sharded by KV head, swapped to host and back with them).

Also decides how many pages the pool gets: `num_pages`, or a memory budget, or (auto) enough
for `max_num_seqs` full-length sequences within what the device can spare. With tensor
parallelism each device holds 1/N of every page (the pool is sharded by KV head), so auto
sizing weighs a device's spare memory against its share.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxcb.config import CacheConfig
from jaxcb.models.base import KVCache, ModelSpec
from pallas_kernels.ragged_paged_attention import kv_pages_shape, pages_per_seq
from pallas_kernels.ragged_paged_attention.kv_quant import is_quantized_kv

logger = logging.getLogger(__name__)

GIB = 1 << 30
CPU_AUTO_BUDGET_BYTES = 4 * GIB  # auto sizing on CPU never takes more than this
#: kv_cache_dtype names of quantized pages and their dtypes ("fp8" is e4m3, as in vLLM).
QUANTIZED_KV_DTYPES = {
    "int8": jnp.dtype(jnp.int8),
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}
SCALE_BYTES = 4  # a quantized row's float32 scale


@dataclass
class DeviceState:
    # Stacked (what a scan over the layers carries): (k_pages, v_pages) of every layer, each
    # [Hkv, L * P, page_size, D] (layer l's pages at l * P ...: models/base.py's
    # layer_metadata); quantized pages also carry (k_scales, v_scales), each
    # f32[Hkv, L * P, page_size]. Unrolled layers: a list of those per layer, [Hkv, P, ...].
    kv_caches: KVCache


jax.tree_util.register_dataclass(DeviceState, data_fields=["kv_caches"], meta_fields=[])


def resolve_kv_cache_dtype(
    name: str, model_dtype: jnp.dtype, attention: str, platform: str | None = None
) -> jnp.dtype:
    """ "auto": the model's dtype, except float32 on CPU with the "xla" backend or a float16
    model (`platform`: where the step will run, default jax's backend). "int8", "fp8" /
    "fp8_e4m3" and "fp8_e5m2": quantized pages (int8, float8_e4m3fn, float8_e5m2) with their
    scales.

    XLA's CPU backend cannot update a bfloat16 buffer in place with a scatter: every KV write
    copies the whole layer's pool (17 ms per write for a 2112-page pool, against 0.01 ms in
    float32). The native CPU backend writes pages in place in any dtype.
    """
    if name in QUANTIZED_KV_DTYPES:
        return QUANTIZED_KV_DTYPES[name]
    if name != "auto":
        return jnp.dtype(name)
    on_cpu = (platform or jax.default_backend()) == "cpu"
    if on_cpu and (attention == "xla" or jnp.dtype(model_dtype) == jnp.float16):
        return jnp.dtype(jnp.float32)  # (float16: the native kernels read no float16 pages)
    return jnp.dtype(model_dtype)


def kv_bytes_per_token(spec: ModelSpec, dtype: Any) -> int:
    """Bytes one token's K and V take across all layers: head_dim values per KV head in
    `dtype`, and for quantized pages each row's float32 scale (int8 at head_dim 64: 68
    bytes a row, 1.06 a value, against 128 in bfloat16)."""
    dtype = jnp.dtype(dtype)
    row = spec.head_dim * dtype.itemsize + (SCALE_BYTES if is_quantized_kv(dtype) else 0)
    return 2 * spec.num_layers * spec.num_kv_heads * row


def page_bytes(spec: ModelSpec, page_size: int, dtype: Any) -> int:
    """Bytes one page takes across all layers (K and V; the scales of quantized pages)."""
    return page_size * kv_bytes_per_token(spec, dtype)


@dataclass(frozen=True)
class PoolSizing:
    """How the pool's page count was decided: what the start-up log and stats() say.

    `source`: "num_pages" or "kv_cache_memory_gb" (given), "cpu budget" (auto on CPU:
    CPU_AUTO_BUDGET_BYTES less the weights), or "device memory" (auto on an accelerator, or
    for an absent target: its memory limit x memory_utilization, less what is in use, the
    weights' share and the compiled step's own buffers). Bytes are per device.
    """

    num_pages: int
    source: str
    wanted_pages: int  # max_num_seqs sequences of max_model_len
    page_bytes: int  # one page's share on one device
    memory_limit_bytes: int = 0  # what the device's allocator may hand out (0: not used)
    utilization: float = 0.0
    in_use_bytes: int = 0  # already allocated when sized (weights restored to the device)
    params_bytes: int = 0  # one device's share of the weights, not yet on it
    program_bytes: int = 0  # the compiled step's temporaries and fresh outputs (largest)

    @property
    def spare_bytes(self) -> int:
        """What the pool may take: the limit x utilization less everything else."""
        budget = self.memory_limit_bytes * (self.utilization if self.source != "cpu budget" else 1)
        return max(0, int(budget) - self.in_use_bytes - self.params_bytes - self.program_bytes)

    def describe(self) -> str:
        if self.source in ("num_pages", "kv_cache_memory_gb"):
            return f"{self.num_pages} pages: {self.source} given"
        gb = 1e9
        why = (
            f"limit {self.memory_limit_bytes / gb:.2f} GB"
            + (f" x {self.utilization:g}" if self.source != "cpu budget" else "")
            + f" - in use {self.in_use_bytes / gb:.2f} - weights {self.params_bytes / gb:.2f}"
            + f" - compiled step {self.program_bytes / gb:.2f} = {self.spare_bytes / gb:.2f} GB"
            + f" per device, {self.page_bytes} bytes a page"
        )
        capped = " (max_num_seqs x max_model_len)" if self.num_pages == self.wanted_pages else ""
        return f"{self.num_pages} pages{capped} from {self.source}: {why}"


def size_kv_pool(
    cache: CacheConfig,
    spec: ModelSpec,
    *,
    dtype: Any,
    max_model_len: int,
    max_num_seqs: int,
    params_bytes: int = 0,
    tensor_parallel_size: int = 1,
    device: jax.Device | None = None,
    memory_limit_bytes: int | None = None,
    program_bytes: int = 0,
) -> PoolSizing:
    """The pool's page count and how it was found. `params_bytes`: what one device will hold
    of the weights not yet on the devices when this is called (sharding.bytes_per_device: a
    replicated array whole, a sharded one its shard). `memory_limit_bytes`: a device's memory
    for a target that is not present (runtime/aot.py); else the device's allocator limit is
    read. `program_bytes`: per device, the compiled step's temporaries and fresh outputs
    (runtime/aot.py's `program_bytes` of the largest bucket), which the pool must leave room
    for. `dtype`: the pages' (a quantized one's pages are counted with their scales)."""
    tp = tensor_parallel_size
    per_page = page_bytes(spec, cache.page_size, dtype)
    min_pages = pages_per_seq(max_model_len, cache.page_size)
    wanted = max_num_seqs * min_pages
    if cache.num_pages is not None:
        sizing = PoolSizing(cache.num_pages, "num_pages", wanted, -(-per_page // tp))
    elif cache.kv_cache_memory_gb is not None:
        num_pages = int(cache.kv_cache_memory_gb * GIB // per_page)
        sizing = PoolSizing(num_pages, "kv_cache_memory_gb", wanted, -(-per_page // tp))
    else:
        limit, in_use = _device_memory(device, memory_limit_bytes)
        sizing = PoolSizing(
            0,
            "cpu budget" if limit is None else "device memory",
            wanted,
            -(-per_page // tp),
            memory_limit_bytes=CPU_AUTO_BUDGET_BYTES if limit is None else limit,
            utilization=cache.memory_utilization,
            in_use_bytes=in_use,
            params_bytes=params_bytes,
            program_bytes=program_bytes if limit is not None else 0,
        )
        num_pages = min(wanted, sizing.spare_bytes // sizing.page_bytes)
        if limit is not None and is_quantized_kv(dtype) and num_pages >= 256:
            # A multiple of 128: on TPU the f32 scales [H, P, page_size] lay the pages along
            # the 128 lanes, and write_kv scatters into them through a 1-D view only then
            # (else by (head, page, offset): in place too, ~6x the bytes by XLA's count).
            num_pages -= num_pages % 128
        sizing = dataclasses.replace(sizing, num_pages=num_pages)
    if sizing.num_pages < min_pages:
        raise ValueError(
            f"the KV pool has {sizing.num_pages} pages of {cache.page_size} tokens "
            f"({sizing.num_pages * cache.page_size} tokens), fewer than max_model_len="
            f"{max_model_len} needs ({min_pages} pages); raise num_pages / kv_cache_memory_gb "
            f"or lower max_model_len ({sizing.describe()})"
        )
    return sizing


def _device_memory(
    device: jax.Device | None, memory_limit_bytes: int | None
) -> tuple[int | None, int]:
    """(allocator limit, bytes in use) of the device; (None, 0) on CPU (no limit known).
    `memory_limit_bytes` stands for an absent device: nothing is in use on it."""
    if memory_limit_bytes is not None:
        return memory_limit_bytes, 0
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None, 0
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def abstract_state(
    spec: ModelSpec,
    *,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding,
    stacked: bool = True,
) -> DeviceState:
    """The state's shapes and shardings, no memory: for compiling for an absent target."""
    arrays = _pool_arrays(spec, num_pages, page_size, dtype, sharding, stacked)
    pool = tuple(jax.ShapeDtypeStruct(shape, kind, sharding=where) for shape, kind, where in arrays)
    return DeviceState(pool if stacked else [pool] * spec.num_layers)


def init_state(
    spec: ModelSpec,
    *,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
    stacked: bool = True,
) -> DeviceState:
    """Zeroed K and V pages of `num_pages` per layer (and zero scales for quantized pages),
    created in place on their devices (`sharding`: the pages', by KV head for tensor
    parallelism; None: the default device). `stacked`: one array per K and V for every
    layer (what a scan over the layers carries), else a (K, V) pair per layer."""
    arrays = _pool_arrays(spec, num_pages, page_size, dtype, sharding, stacked)
    makers = [
        jax.jit(functools.partial(jnp.zeros, shape, kind), out_shardings=where)
        for shape, kind, where in arrays
    ]
    if stacked:
        return DeviceState(tuple(zeros() for zeros in makers))
    return DeviceState([tuple(zeros() for zeros in makers) for _ in range(spec.num_layers)])


def scales_sharding(pages: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """Where a quantized pool's scales [Hkv, P, page_size] go: as their pages
    [Hkv, P, page_size, D] do (split by KV head with tensor parallelism)."""
    if isinstance(pages, NamedSharding):
        return NamedSharding(pages.mesh, PartitionSpec(*tuple(pages.spec)[:3]))
    return pages


def _pool_arrays(
    spec: ModelSpec,
    num_pages: int,
    page_size: int,
    dtype: Any,
    sharding: jax.sharding.Sharding | None,
    stacked: bool,
) -> list[tuple[tuple[int, ...], jnp.dtype, jax.sharding.Sharding | None]]:
    """(shape, dtype, sharding) of the K and V pages of every layer (`stacked`: `num_pages`
    each, in one array) or of one layer, then (quantized pages) of their scales."""
    pages = spec.num_layers * num_pages if stacked else num_pages
    shape = kv_pages_shape(pages, page_size, spec.num_kv_heads, spec.head_dim)
    arrays = [(shape, jnp.dtype(dtype), sharding)] * 2
    if is_quantized_kv(dtype):
        arrays += [(shape[:3], jnp.dtype(jnp.float32), scales_sharding(sharding))] * 2
    return arrays
