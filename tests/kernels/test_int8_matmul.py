"""The native int8 and int4 matmuls (native/matmul.cc, models/quant.py's weights; int4 for
codes in 0..15, GGUF's Q4 blocks): their packed layouts, products equal to the dot with the
dequantized weight on the direct path (few rows) and the dequantize-then-float32 path
(many), the fused SwiGLU, padding rows, and each ISA level."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb import native
from jaxcb.models.quant import dequantize_np, quantize_int8

INT8 = native.INT8_MATMUL
pytestmark = pytest.mark.skipif(not INT8.available(), reason="no int8 kernel on this CPU")
KERNELS = [native.INT8_MATMUL, native.INT4_MATMUL]


def quantized(k: int, n: int, seed: int = 0, bits: int = 8) -> dict[str, np.ndarray]:
    """A [k, n] int8 weight; bits=4: Q4_1-like blocks (codes 0..15, their d and m as grid)."""
    rng = np.random.default_rng(seed)
    if bits == 8:
        w = rng.standard_normal((k, n)) * rng.uniform(0.01, 0.2, n)  # columns of every scale
        return quantize_int8(w.astype(np.float32))
    d = rng.uniform(0.001, 0.05, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.3, 0.0, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (k // 32, 32, n))
    w = (codes * d + m).reshape(k, n).astype(np.float32)
    grid = tuple(np.broadcast_to(a, (k // 32, 32, n)).reshape(k, n) for a in (d, m))
    qw = quantize_int8(w, grid)
    assert native.fits_int4(qw)
    return qw


def kernel_for(bits: int):
    return native.INT8_MATMUL if bits == 8 else native.INT4_MATMUL


def test_pack_layout():
    """Block b, group g: byte 16 r + c is code q[32 g + r, 16 b + c] + 128 (as uint8 of the
    int8), then the 16 float16 scales and the 16 float16 minimums of those columns."""
    qw = quantized(96, 48)
    packed = native.pack_int8(qw)
    assert packed.shape == (3, 3, 576) and packed.dtype == np.uint8
    rng = np.random.default_rng(1)
    for _ in range(50):
        b, g, r, c = (int(rng.integers(s)) for s in (3, 3, 32, 16))
        assert packed[b, g, 16 * r + c].view(np.int8) == qw["q"][32 * g + r, 16 * b + c]
        scales = packed[b, g, 512:544].view(np.float16)
        minimums = packed[b, g, 544:].view(np.float16)
        assert scales[c] == qw["scale"][g, 16 * b + c] and minimums[c] == qw["min"][g, 16 * b + c]


def test_pack_int4_layout():
    """Block b, group g: byte 16 r + c holds the codes (q + 128) of inputs 32 g + r (low
    nibble) and 32 g + r + 16 (high nibble) of column 16 b + c; scales and minimums as int8."""
    qw = quantized(64, 32, bits=4)
    packed = native.pack_int4(qw)
    assert packed.shape == (2, 2, 320) and packed.dtype == np.uint8
    codes = qw["q"].astype(np.int16) + 128
    rng = np.random.default_rng(2)
    for _ in range(50):
        b, g, r, c = (int(rng.integers(s)) for s in (2, 2, 16, 16))
        byte = int(packed[b, g, 16 * r + c])
        assert byte & 15 == codes[32 * g + r, 16 * b + c]
        assert byte >> 4 == codes[32 * g + r + 16, 16 * b + c]
    np.testing.assert_array_equal(packed[:, :, 256:], native.pack_int8(qw)[:, :, 512:])
    assert not native.fits_int4(quantized(64, 32))
    with pytest.raises(ValueError, match=r"outside 0\.\.15"):
        native.pack_int4(quantized(64, 32))


def test_pack_rejects_shapes_off_the_tiles():
    assert native.can_pack_int8((64, 48)) and not native.can_pack_int8((48, 64))
    with pytest.raises(ValueError, match="K must divide by 32"):
        native.pack_int8(quantize_int8(np.ones((40, 16), np.float32)))  # one group of 40
    with pytest.raises(ValueError, match="N by 16"):
        native.pack_int8(quantized(64, 40))


# Rows on each path: 1-4 read the int8 codes directly, more dequantize a slice to float32;
# 130 rows at K = 2048 span several row chunks. N: whole tiles and a ragged last group.
@pytest.mark.parametrize(
    "m, k, n",
    [(1, 32, 16), (2, 64, 48), (3, 96, 80), (4, 576, 1536), (5, 64, 48), (17, 128, 208),
     (64, 512, 768), (130, 2048, 96)],
)  # fmt: skip
@pytest.mark.parametrize("bits", [8, 4])
def test_matmul_is_the_dot_with_the_dequantized_weight(m, k, n, bits):
    qw = quantized(k, n, seed=m, bits=bits)
    spec = kernel_for(bits)
    x = np.random.default_rng(m + 1).standard_normal((m, k)).astype(np.float32)
    got = np.asarray(jax.jit(spec.kernel)(jnp.asarray(x), jnp.asarray(spec.pack(qw))))
    want = x.astype(np.float64) @ dequantize_np(qw).astype(np.float64)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("m, k, i", [(1, 32, 16), (3, 64, 48), (13, 96, 64), (64, 512, 1536)])
@pytest.mark.parametrize("bits", [8, 4])
def test_swiglu_is_silu_gate_times_up(m, k, i, bits):
    qw = quantized(k, 2 * i, seed=i, bits=bits)
    spec = kernel_for(bits)
    x = np.random.default_rng(i).standard_normal((m, k)).astype(np.float32)
    got = np.asarray(jax.jit(spec.swiglu)(jnp.asarray(x), jnp.asarray(spec.pack(qw))))
    gate_up = x.astype(np.float64) @ dequantize_np(qw).astype(np.float64)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    want = gate / (1 + np.exp(-gate)) * up
    assert got.shape == (m, i)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [0, 3, 13])
@pytest.mark.parametrize("bits", [8, 4])
def test_padding_rows_are_skipped_and_zero(rows, bits):
    """Real rows give the full batch's results bit for bit (on the path their count picks:
    3 rows read the codes directly, 13 dequantize), padding rows zeros."""
    qw = quantized(64, 96, seed=rows, bits=bits)
    spec = kernel_for(bits)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((13, 64)), jnp.float32) + 1.0
    packed = jnp.asarray(spec.pack(qw))
    for fn in (spec.kernel, spec.swiglu):
        got = np.asarray(jax.jit(fn)(x, packed, jnp.int32(rows)))
        alone = np.asarray(jax.jit(fn)(x[:rows], packed)) if rows else got[:0]
        np.testing.assert_array_equal(got[:rows], alone)
        assert not got[rows:].any()


@pytest.mark.parametrize("bits", [8, 4])
def test_every_isa_level_gives_the_same_products(bits):
    """The library of each level this CPU runs (AVX2 code, AVX-512 where present)."""
    qw = quantized(128, 64, bits=bits)
    spec = kernel_for(bits)
    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    packed = spec.pack(qw)
    want = x.astype(np.float64) @ dequantize_np(qw).astype(np.float64)
    for level in native.supported_levels():
        if level == "generic":
            continue
        call = jax.ffi.ffi_call(
            native.build.registered_target(spec.matmul_target, level),
            jax.ShapeDtypeStruct((6, 64), jnp.float32),
        )
        for rows in (2, 6):  # the direct path and the dequantizing one
            real = jnp.full(1, rows, jnp.int32)
            got = np.asarray(call(jnp.asarray(x), jnp.asarray(packed), real))
            np.testing.assert_allclose(got[:rows], want[:rows], rtol=1e-5, atol=1e-4)
