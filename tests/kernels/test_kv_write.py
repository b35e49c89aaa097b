"""write_kv: new K/V land in their slots; padding slots (PADDING_SLOT) change nothing."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import PADDING_SLOT, kv_pages_shape, kv_write, write_kv


@functools.partial(jax.jit, donate_argnames=("k_pages", "v_pages"))
def write_donated(k_pages, v_pages, k, v, slot_mapping):
    return write_kv(k_pages, v_pages, k, v, slot_mapping)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_touches_only_real_slots(dtype):
    num_pages, page_size, num_kv_heads, head_dim = 6, 4, 2, 8
    shape = kv_pages_shape(num_pages, page_size, num_kv_heads, head_dim)
    rng = np.random.default_rng(0)
    k_before = rng.standard_normal(shape).astype(np.float32)
    v_before = rng.standard_normal(shape).astype(np.float32)
    # 5 real tokens (two pages, one write straddling a page boundary), then 3 padding rows.
    slots = np.array([9, 10, 11, 12, 22, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT], np.int32)
    k_new = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)

    k_out, v_out = write_donated(
        jnp.asarray(k_before, dtype),
        jnp.asarray(v_before, dtype),
        jnp.asarray(k_new, dtype),
        jnp.asarray(v_new, dtype),
        jnp.asarray(slots),
    )

    for before, new, out in ((k_before, k_new, k_out), (v_before, v_new, v_out)):
        expected = np.asarray(jnp.asarray(before, dtype).astype(jnp.float32))
        expected = expected.reshape(num_kv_heads, num_pages * page_size, head_dim).copy()
        real = slots != PADDING_SLOT
        rounded_new = np.asarray(jnp.asarray(new, dtype).astype(jnp.float32))
        expected[:, slots[real]] = rounded_new[real].swapaxes(0, 1)
        got = np.asarray(out.astype(jnp.float32)).reshape(expected.shape)
        np.testing.assert_array_equal(got, expected)


def test_all_padding_writes_nothing():
    shape = kv_pages_shape(3, 4, 1, 8)
    pages = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    new = jnp.full((4, 1, 8), -1.0)
    slots = jnp.full((4,), PADDING_SLOT, jnp.int32)
    k_out, v_out = write_kv(pages, pages, new, new, slots)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(pages))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(pages))


def expected_write(pages: np.ndarray, new: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """numpy: pages with new[t] at slot slots[t] for every in-range slot."""
    num_kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, head_dim).copy()
    real = (slots >= 0) & (slots < num_pages * page_size)
    flat[:, slots[real]] = new[real].swapaxes(0, 1)
    return flat.reshape(pages.shape)


def random_slots(rng, num_pages: int, page_size: int, num_tokens: int) -> np.ndarray:
    """Distinct real slots (always the pool's very first and last), then invalid ones of every
    kind: PADDING_SLOT, -1, one past the end, a large negative."""
    last = num_pages * page_size - 1
    middle = rng.choice(np.arange(1, last), num_tokens - 6, replace=False)
    invalid = [PADDING_SLOT, -1, last + 1, -(2**30)]
    slots = np.concatenate([[last], middle, [0], invalid]).astype(np.int32)
    return rng.permutation(slots)


@pytest.mark.parametrize(
    "scatter", [kv_write.scatter_by_page, kv_write.scatter_flat], ids=["by_page", "flat"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_scatter_forms_match_numpy(scatter, dtype):
    """Whichever form the platform lowers, the pool ends up the same: the 4-D (page, offset)
    form runs on TPU only, so CPU checks it here directly."""
    num_pages, page_size, num_kv_heads, head_dim = 7, 8, 3, 16
    rng = np.random.default_rng(1)
    shape = kv_pages_shape(num_pages, page_size, num_kv_heads, head_dim)
    pages = np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
    slots = random_slots(rng, num_pages, page_size, num_tokens=40)
    new = np.asarray(
        jnp.asarray(rng.standard_normal((len(slots), num_kv_heads, head_dim)), dtype).astype(
            jnp.float32
        )
    )
    in_range = (slots >= 0) & (slots < num_pages * page_size)
    dropped = np.where(in_range, slots, num_pages * page_size).astype(np.int32)
    got = jax.jit(scatter)(jnp.asarray(pages, dtype), jnp.asarray(new, dtype), dropped)
    np.testing.assert_array_equal(
        np.asarray(got.astype(jnp.float32)), expected_write(pages, new, slots)
    )


def test_invalid_slots_are_dropped_by_write_kv():
    """Negative and past-the-end slots write nothing (a plain `.at[].set` would wrap -1 to
    the last slot)."""
    shape = kv_pages_shape(5, 4, 2, 8)
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    slots = random_slots(rng, 5, 4, num_tokens=16)
    k_new, v_new = (rng.standard_normal((16, 2, 8)).astype(np.float32) for _ in range(2))
    k_out, v_out = write_donated(jnp.asarray(k), jnp.asarray(v), k_new, v_new, slots)
    np.testing.assert_array_equal(np.asarray(k_out), expected_write(k, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), expected_write(v, v_new, slots))


def scatter_index_dims(platform: str) -> list[str]:
    """The `scatter_dims_to_operand_dims` of every scatter in write_kv lowered for platform."""
    pool = jax.ShapeDtypeStruct(kv_pages_shape(64, 16, 2, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((8, 2, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    lowered = jax.jit(write_kv).trace(pool, pool, new, new, slots)
    text = lowered.lower(lowering_platforms=(platform,)).as_text()
    return re.findall(r"scatter_dims_to_operand_dims = \[([0-9, ]*)\]", text)


def test_tpu_lowering_scatters_by_page_and_cpu_by_flat_slot():
    """The TPU program indexes (page, offset) of the 4-D pool (no reshape: finding 1 of
    ACCELERATORS.md); CPU keeps the flat slot scatter, its fastest form there."""
    assert scatter_index_dims("tpu") == ["1, 2", "1, 2"]
    assert scatter_index_dims("cpu") == ["1", "1"]
