"""write_kv: new K/V land in their slots; padding slots (PADDING_SLOT) change nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import PADDING_SLOT, kv_pages_shape, write_kv


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
