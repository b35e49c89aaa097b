"""Device state: the KV page pool (layout from pallas_kernels), and the host memory pages
go to when their request is preempted by swap (HostSwapPool).

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxcb.config import CacheConfig
from jaxcb.models.base import KVCache, ModelSpec
from jaxcb.runtime import sharding as sharding_module
from pallas_kernels.ragged_paged_attention import PADDING_SLOT, kv_pages_shape, pages_per_seq
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
    # per layer (k_pages, v_pages), each [Hkv, P, page_size, D]; quantized pages also carry
    # (k_scales, v_scales), each f32[Hkv, P, page_size]
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
    params_bytes: int = 0  # the weights' share, not yet on the device
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
    """The pool's page count and how it was found. `params_bytes`: weights not yet on the
    devices when this is called (all of them: each of the `tensor_parallel_size` devices
    holds its share). `memory_limit_bytes`: a device's memory for a target that is not
    present (runtime/aot.py); else the device's allocator limit is read. `program_bytes`:
    per device, the compiled step's temporaries and fresh outputs (runtime/aot.py's
    `program_bytes` of the largest bucket), which the pool must leave room for. `dtype`: the
    pages' (a quantized one's pages are counted with their scales)."""
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
            params_bytes=params_bytes // tp,
            program_bytes=program_bytes if limit is not None else 0,
        )
        num_pages = min(wanted, sizing.spare_bytes // sizing.page_bytes)
        if limit is not None and is_quantized_kv(dtype) and num_pages >= 256:
            # A multiple of 128: on TPU the f32 scales [H, P, page_size] lay the pages along
            # the 128 lanes, and write_kv scatters into them in place only then (else XLA
            # copies both scale arrays through VMEM at every write).
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
) -> DeviceState:
    """The state's shapes and shardings, no memory: for compiling for an absent target."""
    layer = tuple(
        jax.ShapeDtypeStruct(shape, kind, sharding=where)
        for shape, kind, where in _layer_arrays(spec, num_pages, page_size, dtype, sharding)
    )
    return DeviceState([layer for _ in range(spec.num_layers)])


def init_state(
    spec: ModelSpec,
    *,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> DeviceState:
    """Zeroed K and V pages per layer (and zero scales for quantized pages), created in
    place on their devices (`sharding`: the pages', by KV head for tensor parallelism;
    None: the default device)."""
    arrays = _layer_arrays(spec, num_pages, page_size, dtype, sharding)
    makers = [
        jax.jit(functools.partial(jnp.zeros, shape, kind), out_shardings=where)
        for shape, kind, where in arrays
    ]
    return DeviceState([tuple(zeros() for zeros in makers) for _ in range(spec.num_layers)])


def scales_sharding(pages: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """Where a quantized pool's scales [Hkv, P, page_size] go: as their pages
    [Hkv, P, page_size, D] do (split by KV head with tensor parallelism)."""
    if isinstance(pages, NamedSharding):
        return NamedSharding(pages.mesh, PartitionSpec(*tuple(pages.spec)[:3]))
    return pages


def _layer_arrays(
    spec: ModelSpec,
    num_pages: int,
    page_size: int,
    dtype: Any,
    sharding: jax.sharding.Sharding | None,
) -> list[tuple[tuple[int, ...], jnp.dtype, jax.sharding.Sharding | None]]:
    """(shape, dtype, sharding) of one layer's K and V pages, then (quantized pages) of
    their scales."""
    shape = kv_pages_shape(num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    arrays = [(shape, jnp.dtype(dtype), sharding)] * 2
    if is_quantized_kv(dtype):
        arrays += [(shape[:3], jnp.dtype(jnp.float32), scales_sharding(sharding))] * 2
    return arrays


# ---- preemption by swap: the host pool and the copies ---------------------------------

#: Incremented each time a swap copy is traced; tests assert it stays put after warm-up.
SWAP_TRACE_COUNT = [0]
#: Bytes the start-up bandwidth measurement copies each way (about; whole pages).
SWAP_PROBE_BYTES = 16 << 20

PagesKV = list[tuple[jax.Array, ...]]  # per layer (K, V[, K scales, V scales]) of some pages


def num_swap_pages(swap_space_gb: float, page_bytes: int) -> int:
    """Host slots (whole KV pages, every layer and head) that `swap_space_gb` GiB hold."""
    return int(swap_space_gb * GIB // page_bytes)


def swap_sizes(pages_per_seq: int) -> tuple[int, ...]:
    """Page counts the swap copies are compiled for: powers of two up to the first that
    holds a whole sequence. A step's page set is padded to the next size (at most 2x the
    bytes), a larger set goes in several copies of the largest."""
    sizes = [1]
    while sizes[-1] < pages_per_seq:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


def gather_pages(state: DeviceState, page_ids: jax.Array) -> PagesKV:
    """Per layer, the K and V of `page_ids` (i32[N]): [Hkv, N, page_size, D] each (and a
    quantized pool's K and V scales, [Hkv, N, page_size]).

    One output per layer and K/V rather than one stacked array: XLA's CPU backend copies a
    stack or a transpose of them at a few hundred MB/s, against memcpy speed for the plain
    gathers (SmolLM2, 64 pages: 10 ms, against 73 ms stacked)."""
    SWAP_TRACE_COUNT[0] += 1
    return [tuple(x[:, page_ids] for x in layer) for layer in state.kv_caches]


def scatter_pages(
    state: DeviceState,
    pages: PagesKV,  # per layer (K, V), [N * page_size, Hkv, D] each: token rows
    slot_mapping: jax.Array,  # i32[N * page_size]: page * page_size + offset; PADDING_SLOT
    *,
    write_kv: Callable[..., tuple[jax.Array, ...]],
    copy_kv: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
) -> DeviceState:
    """Write the rows back into the pool through the attention backend's KV write (in place
    under donation, also on CPU in bfloat16, where an XLA scatter would copy the pool).

    A quantized pool's rows come with their scales ([N * page_size, Hkv] each) and go back
    as they are, codes and scales, through the backend's `copy_kv` (else a plain scatter):
    the KV write would quantize them again, and a dequantized row does not always quantize
    back to the same codes."""
    SWAP_TRACE_COUNT[0] += 1

    def copy(k_pool, v_pool, k_rows, v_rows):
        if copy_kv is not None:
            return copy_kv(k_pool, v_pool, k_rows, v_rows, slot_mapping)
        return put_rows(k_pool, k_rows, slot_mapping), put_rows(v_pool, v_rows, slot_mapping)

    caches = []
    for layer, rows in zip(state.kv_caches, pages, strict=True):
        if len(layer) == 2:
            caches.append(write_kv(*layer, *rows, slot_mapping))
        else:  # (K, V) codes, then (K, V) scales
            caches.append((*copy(*layer[:2], *rows[:2]), *copy(*layer[2:], *rows[2:])))
    return DeviceState(caches)


def put_rows(
    pool: jax.Array,  # [Hkv, P, page_size, D] pages or [Hkv, P, page_size] scales
    rows: jax.Array,  # [T, Hkv, D] or [T, Hkv]
    slot_mapping: jax.Array,  # i32[T]: page * page_size + offset; out of range: dropped
) -> jax.Array:
    """`pool` with row t at slot `slot_mapping[t]`, bit for bit. Float8 pages are scattered
    as int8, the same bytes: XLA's CPU backend would otherwise convert the whole pool to
    float32 and back (77 ms for a 13 MB pool; the int8 views cost two copies, 2.3 ms, and
    an int8 or float32 scatter is in place)."""
    heads, num_pages, page_size, *rest = pool.shape
    slot = jnp.where(
        (slot_mapping >= 0) & (slot_mapping < num_pages * page_size),
        slot_mapping,
        num_pages * page_size,
    )
    as_bytes = jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize == 1
    flat = pool.reshape(heads, num_pages * page_size, *rest)
    new = rows.astype(pool.dtype).swapaxes(0, 1)
    if as_bytes:
        flat = jax.lax.bitcast_convert_type(flat, jnp.int8)
        new = jax.lax.bitcast_convert_type(new, jnp.int8)
    flat = flat.at[:, slot].set(new, mode="drop")
    if as_bytes:
        flat = jax.lax.bitcast_convert_type(flat, pool.dtype)
    return flat.reshape(pool.shape)


class HostSwapPool:
    """The host memory swapped-out KV pages live in, and the two compiled copies.

    `num_slots` slots of one page each, all heads (with tensor parallelism the devices'
    shards are gathered), laid out [layers, 2 (K, V), slots, page_size, Hkv, D]: a layer's
    K rows of some slots are one fancy-indexed take, in the token-row layout the KV write
    reads. A quantized pool's scales sit beside them, [layers, 2, slots, page_size, Hkv]
    float32, and move with their pages. The host side decides which slot holds which page
    (engine/swap.py); here the pages only move. A step's pages go out in one gather (one
    compiled call, its outputs fetched together) and come in through one compiled KV write
    (quantized pages: their codes and scales copied back bit for bit), each padded to a size of
    `swap_sizes`: 2 x len(sizes) small compiles, done at start-up."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        num_slots: int,
        num_pages: int,
        page_size: int,
        pages_per_seq: int,
        dtype: jnp.dtype,
        state_shardings: Any,
        write_kv: Callable[..., tuple[jax.Array, ...]],
        mesh: jax.sharding.Mesh,
        copy_kv: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
    ) -> None:
        self.num_layers, self.num_kv_heads = spec.num_layers, spec.num_kv_heads
        self.head_dim, self.page_size = spec.head_dim, page_size
        slot_shape = (page_size, spec.num_kv_heads, spec.head_dim)
        # np.zeros maps the pool lazily: host memory is taken as slots are first written.
        self.pages = np.zeros((spec.num_layers, 2, num_slots, *slot_shape), dtype)
        self.scales = None
        if is_quantized_kv(dtype):
            self.scales = np.zeros((spec.num_layers, 2, num_slots, *slot_shape[:2]), np.float32)
        self.page_bytes = page_bytes(spec, page_size, dtype)
        self.num_slots = num_slots
        self.num_pages = num_pages
        self.sizes = swap_sizes(min(pages_per_seq, num_pages))
        heads = sharding_module.kv_pages_sharding(mesh).spec[0]  # the KV-head mesh axis
        gathered = NamedSharding(mesh, PartitionSpec(heads, None, None, None))  # [Hkv, N, ..]
        rows = NamedSharding(mesh, PartitionSpec(None, heads, None))  # [T, Hkv, D]
        gathered_layer, rows_layer = (gathered, gathered), (rows, rows)
        if self.scales is not None:  # [Hkv, N, page_size] and [T, Hkv]
            gathered_scales = NamedSharding(mesh, PartitionSpec(heads, None, None))
            scale_rows = NamedSharding(mesh, PartitionSpec(None, heads))
            gathered_layer += (gathered_scales, gathered_scales)
            rows_layer += (scale_rows, scale_rows)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._gather = jax.jit(
            gather_pages,
            in_shardings=(state_shardings, replicated),
            out_shardings=[gathered_layer] * spec.num_layers,
        )
        self._scatter = jax.jit(
            functools.partial(scatter_pages, write_kv=write_kv, copy_kv=copy_kv),
            donate_argnames=("state",),
            in_shardings=(state_shardings, [rows_layer] * spec.num_layers, replicated),
            out_shardings=state_shardings,
        )
        self._gathers: dict[int, jax.stages.Compiled] = {}
        self._scatters: dict[int, jax.stages.Compiled] = {}

    def compile(self, state: DeviceState) -> float:
        """Compile both copies for every size; returns seconds."""
        t0 = time.perf_counter()
        for n in self.sizes:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            rows = jax.ShapeDtypeStruct(
                (n * self.page_size, self.num_kv_heads, self.head_dim), self.pages.dtype
            )
            layer = (rows, rows)
            if self.scales is not None:
                scales = jax.ShapeDtypeStruct((n * self.page_size, self.num_kv_heads), jnp.float32)
                layer += (scales, scales)
            slots = jax.ShapeDtypeStruct((n * self.page_size,), jnp.int32)
            self._gathers[n] = self._gather.lower(state, ids).compile()
            pages = [layer] * self.num_layers
            self._scatters[n] = self._scatter.lower(state, pages, slots).compile()
        seconds = time.perf_counter() - t0
        logger.info(
            "compiled the KV swap copies for %d page counts (up to %d) in %.2fs",
            len(self.sizes),
            self.sizes[-1],
            seconds,
        )
        return seconds

    def _batches(self, n: int) -> list[tuple[int, int, int]]:
        """(start, count, compiled size) of the copies that move n pages."""
        largest, out = self.sizes[-1], []
        for start in range(0, n, largest):
            count = min(largest, n - start)
            out.append((start, count, next(s for s in self.sizes if s >= count)))
        return out

    def swap_out(self, state: DeviceState, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device `pages` into host `slots` (waits for the copy: the pages may be
        overwritten by the next step)."""
        pages, slots = np.asarray(pages, np.int32), np.asarray(slots, np.int64)
        for start, count, size in self._batches(len(pages)):
            ids = np.full(size, pages[start], np.int32)  # padding re-reads a real page
            ids[:count] = pages[start : start + count]
            into = slots[start : start + count]
            gathered = jax.device_get(self._gathers[size](state, ids))
            for layer, arrays in enumerate(gathered):
                for i, x in enumerate(arrays[:2]):  # [Hkv, N, ps, D] -> slots of [ps, Hkv, D]
                    self.pages[layer, i, into] = np.asarray(x)[:, :count].transpose(1, 2, 0, 3)
                for i, x in enumerate(arrays[2:]):  # [Hkv, N, ps] -> slots of [ps, Hkv]
                    self.scales[layer, i, into] = np.asarray(x)[:, :count].transpose(1, 2, 0)

    def swap_in(
        self, state: DeviceState, slots: Sequence[int], pages: Sequence[int]
    ) -> DeviceState:
        """Copy host `slots` into device `pages`; returns the new state (the old one is
        donated)."""
        slots, pages = np.asarray(slots, np.int64), np.asarray(pages, np.int32)
        offsets = np.arange(self.page_size, dtype=np.int32)
        for start, count, size in self._batches(len(pages)):
            take = np.full(size, slots[start], np.int64)  # padding rows are written nowhere
            take[:count] = slots[start : start + count]
            slot_mapping = np.full((size, self.page_size), PADDING_SLOT, np.int32)
            slot_mapping[:count] = pages[start : start + count, None] * self.page_size + offsets
            rows = (size * self.page_size, self.num_kv_heads, self.head_dim)
            data = [
                tuple(self.pages[layer, i, take].reshape(rows) for i in (0, 1))
                + tuple(
                    self.scales[layer, i, take].reshape(rows[:2])
                    for i in ((0, 1) if self.scales is not None else ())
                )
                for layer in range(self.num_layers)
            ]
            state = self._scatters[size](state, data, slot_mapping.reshape(-1))
        return state

    def measure_bandwidth(self, state: DeviceState) -> tuple[DeviceState, float]:
        """Device-host bytes per second, one direction: about SWAP_PROBE_BYTES of pages
        copied out and back in (the best of three, after one untimed round). Only at
        start-up: it overwrites the first pages and slots. Returns the new state too."""
        n = max(1, min(SWAP_PROBE_BYTES // self.page_bytes, self.num_slots, self.num_pages))
        ids = list(range(n))
        best = float("inf")
        for attempt in range(4):
            t0 = time.perf_counter()
            self.swap_out(state, ids, ids)
            state = self.swap_in(state, ids, ids)
            jax.block_until_ready(state)
            if attempt:
                best = min(best, time.perf_counter() - t0)
        return state, 2 * n * self.page_bytes / best
