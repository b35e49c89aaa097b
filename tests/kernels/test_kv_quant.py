"""quantize_rows / is_quantized_kv (kv_quant.py): one scale per token-head row, the row's
largest magnitude on QMAX, zeros kept, round-trip error within the dtype's bound."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    QMAX,
    QUANTIZED_KV_DTYPES,
    dequantize,
    is_quantized_kv,
    quantize_rows,
)

#: name -> (numpy dtype, smallest normal magnitude, mantissa bits): fp8 round-trip bounds.
FP8 = {
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, 2.0**-6, 3),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, 2.0**-14, 2),
}


def rows(seed: int = 0) -> np.ndarray:
    """[5, 3, 64] f32 rows of very different magnitudes, one all-zero row, one with zeros and
    one spanning 11 decades (so e4m3 and e5m2 meet subnormals)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 6, (5, 3, 1))
    x[1, 2] = 0.0
    x[3, 0, ::2] = 0.0
    x[4, 1] = np.geomspace(1e-11, 1.0, 64, dtype=np.float32) * np.sign(x[4, 1])
    return x


def numpy_quantize(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The interface's definition, in numpy."""
    qmax = np.float32(QMAX[QUANTIZED_KV_DTYPES[name]])
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax == 0, np.float32(1), amax / qmax).astype(np.float32)
    y = x / scale[..., None]
    if name == "int8":
        return np.clip(np.round(y), -127, 127).astype(np.int8), scale
    return y.astype(FP8[name][0]), scale


@pytest.mark.parametrize("name", sorted(QUANTIZED_KV_DTYPES))
def test_matches_the_definition(name):
    x = rows()
    values, scales = quantize_rows(jnp.asarray(x), QUANTIZED_KV_DTYPES[name])
    expected_values, expected_scales = numpy_quantize(x, name)
    assert values.dtype == QUANTIZED_KV_DTYPES[name] and values.shape == x.shape
    assert scales.dtype == jnp.float32 and scales.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(scales), expected_scales)
    np.testing.assert_array_equal(
        np.asarray(values).astype(np.float32), expected_values.astype(np.float32)
    )


@pytest.mark.parametrize("name", sorted(QUANTIZED_KV_DTYPES))
def test_zeros_stay_zeros_and_the_largest_value_is_qmax(name):
    x = rows(1)
    values, scales = quantize_rows(jnp.asarray(x), QUANTIZED_KV_DTYPES[name])
    values = np.asarray(values).astype(np.float32)
    assert np.asarray(scales)[1, 2] == 1.0
    np.testing.assert_array_equal(values[1, 2], 0.0)
    np.testing.assert_array_equal(values[x == 0], 0.0)
    nonzero = np.abs(x).max(axis=-1) > 0
    np.testing.assert_array_equal(
        np.abs(values).max(axis=-1)[nonzero], QMAX[QUANTIZED_KV_DTYPES[name]]
    )


def test_int8_round_trip_is_within_half_a_step():
    x = rows(2)
    values, scales = quantize_rows(jnp.asarray(x), jnp.int8)
    error = np.abs(np.asarray(dequantize(values, scales)) - x)
    bound = np.asarray(scales)[..., None] * (0.5 + 1e-5)  # + f32 rounding of x / scale
    assert np.all(error <= bound)
    assert np.asarray(values).min() >= -127  # symmetric: -128 unused


@pytest.mark.parametrize("name", sorted(FP8))
def test_fp8_round_trip_relative_error(name):
    """Normal values: relative error <= 2**-(mantissa bits + 1); subnormal ones (|x| / scale
    below the smallest normal): at most half the subnormal step, times the scale."""
    _, min_normal, mantissa = FP8[name]
    x = rows(3)
    values, scales = quantize_rows(jnp.asarray(x), QUANTIZED_KV_DTYPES[name])
    scales = np.asarray(scales)[..., None]
    error = np.abs(np.asarray(dequantize(values, scales.squeeze(-1))) - x)
    normal = np.abs(x) >= min_normal * scales
    assert normal.sum() > 0.8 * x.size and np.sum(~normal & (x != 0)) > 5
    relative = 2.0 ** -(mantissa + 1) * (1 + 1e-5)
    assert np.all(error[normal] <= relative * np.abs(x[normal]))
    subnormal_bound = 0.5 * min_normal * 2.0**-mantissa * (1 + 1e-5) * scales  # [..., 1]
    assert np.all(error[~normal] <= np.broadcast_to(subnormal_bound, x.shape)[~normal])


def test_bfloat16_rows_are_quantized_from_their_values():
    x = jnp.asarray(rows(4), jnp.bfloat16)
    values, scales = quantize_rows(x, jnp.int8)
    expected_values, expected_scales = numpy_quantize(np.asarray(x.astype(jnp.float32)), "int8")
    np.testing.assert_array_equal(np.asarray(values), expected_values)
    np.testing.assert_array_equal(np.asarray(scales), expected_scales)


def test_is_quantized_kv():
    for dtype in ("int8", jnp.int8, jnp.float8_e4m3fn, jnp.dtype("float8_e5m2")):
        assert is_quantized_kv(dtype)
    for dtype in ("float32", jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fnuz, "auto"):
        assert not is_quantized_kv(dtype)
    expected = {
        "int8": jnp.dtype(jnp.int8),
        "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
        "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
    }
    assert expected == QUANTIZED_KV_DTYPES


def test_unquantized_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="bfloat16 are not quantized"):
        quantize_rows(jnp.ones((2, 8)), jnp.bfloat16)
