"""The AVX2 kernels' two micro-tile shapes for many-row products (native/matmul.cc, TileShape:
"wide", 2 rows x 3 blocks of 16 columns; "tall", 6 x 1, 4 x 1 for widened bfloat16), one of
which a timing probe picks per CPU and weight form. Whichever runs, every output is the same
float32 sum along K in the same order: both shapes give each product bit for bit, on every
path that tiles (plain, fused SwiGLU, the LM head's argmax, grouped experts, int8 / int4
weights dequantized by slices). The other kernel tests check the probed shape against
references; these force each shape in turn, so both are checked on any CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb import native
from jaxcb.models.quant import quantize_int8

pytestmark = pytest.mark.skipif(
    not native.PACKED_MATMULS["avx2"].available(), reason="no AVX2 kernels on this CPU"
)
LEVEL = "avx2"  # the AVX2 kernels' library (AVX-512 libraries have one shape)


@pytest.fixture
def force():
    """force(shape) for the test; the probe's choice again afterwards."""
    yield functools.partial(native.force_tile_shape, level=LEVEL)
    native.force_tile_shape(None, LEVEL)


def both_shapes(force, fn, *args):
    """fn(*args) under the wide tiles and under the tall ones: asserted equal bit for bit;
    returns one (a tuple of outputs as numpy arrays)."""
    outs = {}
    for shape in native.TILE_SHAPES:
        force(shape)
        got = fn(*args)
        outs[shape] = tuple(np.asarray(a) for a in (got if isinstance(got, tuple) else (got,)))
    for wide, tall in zip(outs["wide"], outs["tall"], strict=True):
        assert wide.dtype == tall.dtype and np.array_equal(wide, tall, equal_nan=True)
    return outs["tall"]


def test_probe_names_a_shape_per_form_and_can_be_forced(force):
    probed = native.tile_shapes(LEVEL)
    assert set(probed) == {"f32", "bf16"} and set(probed.values()) <= set(native.TILE_SHAPES)
    for shape in native.TILE_SHAPES:
        force(shape)
        assert native.tile_shapes(LEVEL) == {"f32": shape, "bf16": shape}
    force(None)
    assert native.tile_shapes(LEVEL) == probed  # probed once per process: the same answer
    with pytest.raises(ValueError, match="tile shape must be one of"):
        force("square")


KERNELS = ["avx2", "avx2_bf16"]
# Rows below a tall tile (5), across several with a remainder (13, 130), and K past a page.
SHAPES = [(5, 64, 64), (13, 96, 96), (64, 512, 768), (130, 256, 160)]


def _inputs(spec, m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = np.asarray(rng.standard_normal((k, n)).astype(np.float32)).astype(spec.dtype)
    return x, w


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_matmul_swiglu_and_argmax_agree_across_shapes(force, kernel, m, k, n):
    spec = native.PACKED_MATMULS[kernel]
    x, w = _inputs(spec, m, k, n, m + n)
    packed = jnp.asarray(spec.pack(w))
    (out,) = both_shapes(force, jax.jit(spec.kernel), x, packed)
    reference = np.asarray(x.astype(spec.dtype), np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
    logits, best = both_shapes(force, jax.jit(spec.argmax), x, packed)
    np.testing.assert_array_equal(logits, out)
    np.testing.assert_array_equal(best, out.argmax(axis=1))
    (act,) = both_shapes(force, jax.jit(spec.swiglu), x, packed)  # gate: w[:, :n/2]
    assert act.shape == (m, n // 2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_matmuls_agree_across_shapes(force, kernel):
    spec = native.PACKED_MATMULS[kernel]
    rng = np.random.default_rng(3)
    m, k, n, sizes = 70, 128, 96, [40, 0, 21, 1, 6]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32).astype(spec.dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    stack = jnp.asarray(native.pack_experts(kernel, w))
    matmul = jax.jit(functools.partial(native.packed_grouped_matmul, kernel))
    (out,) = both_shapes(force, matmul, x, stack, group_sizes)
    assert out[:40].any() and not out[sum(sizes) :].any()
    swiglu = jax.jit(functools.partial(native.packed_grouped_swiglu, kernel))
    gate_up = jnp.asarray(native.pack_experts(kernel, w.reshape(len(sizes), k, 2, n // 2)))
    both_shapes(force, swiglu, x, gate_up, group_sizes)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [5, 13, 64])
def test_quantized_many_row_products_agree_across_shapes(force, bits, m):
    """int8 / int4 weights past the integer path's rows: slices dequantized to float32 and
    run through the same tiles."""
    rng = np.random.default_rng(m)
    k, n = 128, 96
    if bits == 8:
        qw = quantize_int8(rng.standard_normal((k, n)).astype(np.float32))
    else:  # codes in 0..15 (Q4_1-like groups): the 4-bit kernel
        d = rng.uniform(0.001, 0.05, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
        codes = rng.integers(0, 16, (k // 32, 32, n))
        w = (codes * d).reshape(k, n).astype(np.float32)
        grid = tuple(np.broadcast_to(a, (k // 32, 32, n)).reshape(k, n) for a in (d, 0 * d))
        qw = quantize_int8(w, grid)
        assert native.fits_int4(qw)
    spec = native.INT4_MATMUL if bits == 4 else native.INT8_MATMUL
    packed = jnp.asarray(spec.pack(qw))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    (out,) = both_shapes(force, jax.jit(spec.kernel), x, packed)
    assert out.shape == (m, n) and np.isfinite(out).all()
    both_shapes(force, jax.jit(spec.swiglu), x, packed)
