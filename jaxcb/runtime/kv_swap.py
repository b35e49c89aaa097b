"""Preemption by swap: the host memory a preempted request's KV pages go to (HostSwapPool),
and the jitted copies between it and the device pool (kv_cache.py's DeviceState).

A quantized pool's scales travel with their pages; the copies are compiled for a few page
counts (`swap_sizes`) at start-up, never after.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxcb.models.base import ModelSpec
from jaxcb.runtime import sharding as sharding_module
from jaxcb.runtime.kv_cache import GIB, DeviceState, page_bytes
from pallas_kernels.ragged_paged_attention import PADDING_SLOT
from pallas_kernels.ragged_paged_attention.kv_quant import is_quantized_kv

logger = logging.getLogger(__name__)

# ---- preemption by swap: the host pool and the copies ---------------------------------

#: Incremented each time a swap copy is traced; tests assert it stays put after warm-up.
SWAP_TRACE_COUNT = [0]
#: Bytes the start-up bandwidth measurement copies each way (about; whole pages).
SWAP_PROBE_BYTES = 16 << 20

# (K, V[, K scales, V scales]) of some pages of every layer (a stacked pool), or a list of
# those per layer (a pool per layer: unrolled layers)
PagesKV = tuple[jax.Array, ...] | list[tuple[jax.Array, ...]]


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


def every_layer(ids: jax.Array, num_layers: int, per_layer: int) -> jax.Array:
    """Ids counted within a layer's share of the pool (pages, or slots: `per_layer` of
    them a layer) as ids of the whole pool, layer-major: [L * N]. Out-of-range ids
    (PADDING_SLOT) stay out of range."""
    in_layer = (ids >= 0) & (ids < per_layer)
    offsets = jnp.arange(num_layers, dtype=ids.dtype)[:, None] * per_layer
    return jnp.where(in_layer[None], ids[None] + offsets, PADDING_SLOT).reshape(-1)


def gather_pages(state: DeviceState, page_ids: jax.Array, *, num_layers: int) -> PagesKV:
    """The K and V of `page_ids` (i32[N], a layer's page numbers) in every layer:
    [Hkv, L * N, page_size, D] each, layer-major (and a quantized pool's K and V scales,
    [Hkv, L * N, page_size]); from a pool per layer, a list of [Hkv, N, ...] per layer.

    One plain gather per array, not a stack or a transpose: XLA's CPU backend copies those
    at a few hundred MB/s, against memcpy speed for a gather (SmolLM2, 64 pages: 10 ms,
    against 73 ms stacked)."""
    SWAP_TRACE_COUNT[0] += 1
    pool = state.kv_caches
    if isinstance(pool, list):
        return [tuple(x[:, page_ids] for x in layer) for layer in pool]
    ids = every_layer(page_ids, num_layers, pool[0].shape[1] // num_layers)
    return tuple(x[:, ids] for x in pool)


def scatter_pages(
    state: DeviceState,
    pages: PagesKV,  # (K, V), [L * N * page_size, Hkv, D] each: token rows, layer-major
    slot_mapping: jax.Array,  # i32[N * page_size]: a layer's page * page_size + offset
    *,
    num_layers: int,
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

    def write(pool: tuple, rows: tuple, slots: jax.Array) -> tuple:
        if len(pool) == 2:
            return tuple(write_kv(*pool, *rows, slots))
        if copy_kv is not None:  # (K, V) codes, then (K, V) scales
            return (*copy_kv(*pool[:2], *rows[:2], slots), *copy_kv(*pool[2:], *rows[2:], slots))
        return tuple(put_rows(x, r, slots) for x, r in zip(pool, rows, strict=True))

    pool = state.kv_caches
    if isinstance(pool, list):  # a pool per layer
        return DeviceState(
            [write(layer, rows, slot_mapping) for layer, rows in zip(pool, pages, strict=True)]
        )
    slots_per_layer = pool[0].shape[1] // num_layers * pool[0].shape[2]
    return DeviceState(write(pool, pages, every_layer(slot_mapping, num_layers, slots_per_layer)))


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
    (engine/sched/swap.py); here the pages only move. A step's pages go out in one gather (one
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
        stacked: bool = True,
    ) -> None:
        """`stacked`: the device pool is one array per K and V for every layer (kv_cache.py),
        else a (K, V) pair per layer."""
        self.num_layers, self.num_kv_heads = spec.num_layers, spec.num_kv_heads
        self.stacked = stacked
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
        gathered_pool, rows_pool = (gathered, gathered), (rows, rows)
        if self.scales is not None:  # [Hkv, N, page_size] and [T, Hkv]
            gathered_scales = NamedSharding(mesh, PartitionSpec(heads, None, None))
            scale_rows = NamedSharding(mesh, PartitionSpec(None, heads))
            gathered_pool += (gathered_scales, gathered_scales)
            rows_pool += (scale_rows, scale_rows)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._gather = jax.jit(
            functools.partial(gather_pages, num_layers=spec.num_layers),
            in_shardings=(state_shardings, replicated),
            out_shardings=gathered_pool if stacked else [gathered_pool] * spec.num_layers,
        )
        self._scatter = jax.jit(
            functools.partial(
                scatter_pages, num_layers=spec.num_layers, write_kv=write_kv, copy_kv=copy_kv
            ),
            donate_argnames=("state",),
            in_shardings=(
                state_shardings,
                rows_pool if stacked else [rows_pool] * spec.num_layers,
                replicated,
            ),
            out_shardings=state_shardings,
        )
        self._gathers: dict[int, jax.stages.Compiled] = {}
        self._scatters: dict[int, jax.stages.Compiled] = {}

    def compile(self, state: DeviceState) -> float:
        """Compile both copies for every size; returns seconds."""
        t0 = time.perf_counter()
        for n in self.sizes:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            num_rows = (self.num_layers if self.stacked else 1) * n * self.page_size
            rows = jax.ShapeDtypeStruct(
                (num_rows, self.num_kv_heads, self.head_dim), self.pages.dtype
            )
            pages = (rows, rows)
            if self.scales is not None:
                scales = jax.ShapeDtypeStruct((num_rows, self.num_kv_heads), jnp.float32)
                pages += (scales, scales)
            slots = jax.ShapeDtypeStruct((n * self.page_size,), jnp.int32)
            self._gathers[n] = self._gather.lower(state, ids).compile()
            if not self.stacked:
                pages = [pages] * self.num_layers
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
            heads, layers = self.num_kv_heads, self.num_layers
            if not self.stacked:  # per layer [Hkv, N, ...] -> [Hkv, L * N, ...]
                gathered = [np.concatenate(x, axis=1) for x in zip(*gathered, strict=True)]
            for i, x in enumerate(gathered[:2]):  # [Hkv, L * N, ps, D] -> [L, slots, ps, Hkv, D]
                x = np.asarray(x).reshape(heads, layers, size, *x.shape[2:])[:, :, :count]
                self.pages[:, i, into] = x.transpose(1, 2, 3, 0, 4)
            for i, x in enumerate(gathered[2:]):  # [Hkv, L * N, ps] -> [L, slots, ps, Hkv]
                x = np.asarray(x).reshape(heads, layers, size, *x.shape[2:])[:, :, :count]
                self.scales[:, i, into] = x.transpose(1, 2, 3, 0)

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
            rows = (self.num_layers, size * self.page_size, self.num_kv_heads, self.head_dim)
            data = tuple(self.pages[:, i, take].reshape(rows) for i in (0, 1))
            if self.scales is not None:
                data += tuple(self.scales[:, i, take].reshape(rows[:3]) for i in (0, 1))
            if self.stacked:  # [L * N * ps, ...] rows, layer-major
                data = tuple(x.reshape(-1, *x.shape[2:]) for x in data)
            else:
                data = [tuple(x[layer] for x in data) for layer in range(self.num_layers)]
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
