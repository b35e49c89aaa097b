"""write_kv: new K/V land in their slots; padding slots (PADDING_SLOT) change nothing. A
quantized pool (int8 / fp8 pages with scales) gets each new row's values and scale."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kv_quant import numpy_quantize

from pallas_kernels.ragged_paged_attention import (
    PADDING_SLOT,
    QUANTIZED_KV_DTYPES,
    kv_pages_shape,
    kv_scales_shape,
    kv_write,
    quantize_rows,
    write_kv,
)


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
    """numpy: pages with new[t] at slot slots[t] for every in-range slot (pages [H, P, ps, D]
    with new [T, H, D], or scales [H, P, ps] with new [T, H])."""
    num_kv_heads, num_pages, page_size, *rest = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, *rest).copy()
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
    """The TPU program indexes (head, page, offset) of the 4-D pool, a head_dim row per
    update (no reshape: finding 1 of ACCELERATORS.md; no heads in the window: the scan's
    pool stays row-major, test_rpa_tpu_compile.py); CPU keeps the flat slot scatter, its
    fastest form there."""
    assert scatter_index_dims("tpu") == ["0, 1, 2", "0, 1, 2"]
    assert scatter_index_dims("cpu") == ["1", "1"]


# --- quantized pool -----------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnames=("k_pages", "v_pages", "k_scales", "v_scales"))
def write_quantized_donated(k_pages, v_pages, k, v, slot_mapping, k_scales, v_scales):
    return write_kv(k_pages, v_pages, k, v, slot_mapping, k_scales=k_scales, v_scales=v_scales)


@pytest.mark.parametrize("name", sorted(QUANTIZED_KV_DTYPES))
def test_quantized_write_stores_each_rows_values_and_scale(name):
    """Values and scales as the definition (numpy) gives them, at in-range slots only; a zero
    row is stored as zeros with scale 1."""
    num_pages, page_size, num_kv_heads, head_dim = 5, 4, 2, 16
    dtype = QUANTIZED_KV_DTYPES[name]
    rng = np.random.default_rng(3)
    pools = []
    for _ in range(2):  # K, V: a pool already holding quantized rows
        pool = rng.standard_normal(kv_pages_shape(num_pages, page_size, num_kv_heads, head_dim))
        pools.append(quantize_rows(jnp.asarray(pool, jnp.float32), dtype))
    slots = random_slots(rng, num_pages, page_size, num_tokens=16)
    new = [rng.standard_normal((16, num_kv_heads, head_dim)).astype(np.float32) for _ in "kv"]
    zero_row = int(np.argmax(slots == 0))  # a real slot
    new[0][zero_row] = 0.0
    before = [(np.asarray(x.astype(jnp.float32)), np.asarray(s)) for x, s in pools]

    out = write_quantized_donated(
        pools[0][0], pools[1][0], new[0], new[1], slots, k_scales=pools[0][1], v_scales=pools[1][1]
    )

    assert len(out) == 4
    k_pages, v_pages, k_scales, v_scales = out
    assert k_pages.dtype == v_pages.dtype == dtype
    assert k_scales.shape == kv_scales_shape(num_pages, page_size, num_kv_heads)
    for (values_before, scales_before), rows, pages, scales in zip(
        before, new, (k_pages, v_pages), (k_scales, v_scales), strict=True
    ):
        values, row_scales = numpy_quantize(rows, name)
        np.testing.assert_array_equal(
            np.asarray(pages.astype(jnp.float32)),
            expected_write(values_before, values.astype(np.float32), slots),
        )
        np.testing.assert_array_equal(
            np.asarray(scales), expected_write(scales_before, row_scales, slots)
        )
    page, offset = divmod(int(slots[zero_row]), page_size)
    np.testing.assert_array_equal(np.asarray(k_pages[:, page, offset].astype(jnp.float32)), 0.0)
    np.testing.assert_array_equal(np.asarray(k_scales[:, page, offset]), 1.0)


def test_quantized_all_padding_writes_nothing():
    values = jnp.full(kv_pages_shape(3, 4, 1, 8), 5, jnp.int8)
    scales = jnp.full(kv_scales_shape(3, 4, 1), 0.5, jnp.float32)
    new = jnp.full((4, 1, 8), -1.0)
    slots = jnp.full((4,), PADDING_SLOT, jnp.int32)
    out = write_kv(values, values, new, new, slots, k_scales=scales, v_scales=scales)
    for got, before in zip(out, (values, values, scales, scales), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(before))


SCATTERS = {
    "by_page": kv_write.scatter_by_page,
    "flat": kv_write.scatter_flat,
    "tpu": kv_write.scatter_scales_tpu,
}


@pytest.mark.parametrize(
    ("num_pages", "page_size"),
    [(128, 8), (256, 16), (16, 128), (24, 256), (7, 8)],
    ids=["tiles_of_pages", "tiles_of_pages_16", "tiles_of_slots", "tiles_of_slots_256", "ragged"],
)
@pytest.mark.parametrize("form", sorted(SCATTERS))
def test_every_scale_scatter_form_matches_numpy(form, num_pages, page_size):
    """The scales ([H, P, ps], no head_dim axis): the two page forms, and the TPU form (a 1-D
    view in TPU memory order: pages on lanes below 128 slots a page, slots on lanes from 128;
    other shapes fall back to by_page), run here on CPU."""
    num_kv_heads = 3
    rng = np.random.default_rng(4)
    scales = rng.random(kv_scales_shape(num_pages, page_size, num_kv_heads)).astype(np.float32)
    slots = random_slots(rng, num_pages, page_size, num_tokens=40)
    new = rng.random((len(slots), num_kv_heads)).astype(np.float32)
    in_range = (slots >= 0) & (slots < num_pages * page_size)
    dropped = np.where(in_range, slots, num_pages * page_size).astype(np.int32)
    got = jax.jit(SCATTERS[form])(jnp.asarray(scales), jnp.asarray(new), dropped)
    np.testing.assert_array_equal(np.asarray(got), expected_write(scales, new, slots))


def test_quantized_write_scatters_in_place_forms_per_platform():
    """TPU: values by (head, page, offset) on the 4-D pool, scales along a 1-D view of their tiles
    (a bitcast there, scattered in place: test_rpa_tpu_compile.py); elsewhere: the flat slot."""
    pool = jax.ShapeDtypeStruct(kv_pages_shape(128, 16, 2, 128), jnp.int8)
    scales = jax.ShapeDtypeStruct(kv_scales_shape(128, 16, 2), jnp.float32)
    new = jax.ShapeDtypeStruct((8, 2, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32)
    traced = jax.jit(write_kv).trace(pool, pool, new, new, slots, scales, scales)
    for platform, dims in (("tpu", ["0, 1, 2", "0, 1, 2", "0", "0"]), ("cpu", ["1"] * 4)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        found = re.findall(r"scatter_dims_to_operand_dims = \[([0-9, ]*)\]", text)
        assert found == dims, (platform, found)
