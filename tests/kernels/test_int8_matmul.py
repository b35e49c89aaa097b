"""The native int8 and int4 matmuls (native/quant_matmul.h, models/quant.py's weights; int4
for codes in 0..15, GGUF's Q4 blocks): their packed layouts; products equal to the dot with
the dequantized weight on the dequantize-then-float32 path (more than 4 rows), and within
the activation codes' rounding bound of it on the integer path (up to 4 rows); the fused
SwiGLU, padding rows, and each ISA level."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import isa_level_params

from jaxcb import native
from jaxcb.models.quant import dequantize_np, quantize_int8

INT8 = native.INT8_MATMUL
pytestmark = pytest.mark.skipif(not INT8.available(), reason="no int8 kernel on this CPU")
KERNELS = [native.INT8_MATMUL, native.INT4_MATMUL]


#: Weight forms: int8 (asymmetric groups), Q8_0 blocks (int8, symmetric: packed without
#: minimums), 4-bit (Q4_1 blocks).
FORMS = [8, "q8_0", 4]


def quantized(k: int, n: int, seed: int = 0, bits: int | str = 8) -> dict[str, np.ndarray]:
    """A [k, n] int8 weight; bits="q8_0": Q8_0-like blocks (d x q, q in -128..127, their d and
    -128 d as grid); bits=4: Q4_1-like blocks (codes 0..15, their d and m as grid)."""
    rng = np.random.default_rng(seed)
    if bits == 8:
        w = rng.standard_normal((k, n)) * rng.uniform(0.01, 0.2, n)  # columns of every scale
        return quantize_int8(w.astype(np.float32))
    if bits == "q8_0":
        d = rng.uniform(0.0001, 0.002, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
        codes = rng.integers(-128, 128, (k // 32, 32, n))
        w = (codes * d).reshape(k, n).astype(np.float32)
        grid = tuple(np.broadcast_to(a, (k // 32, 32, n)).reshape(k, n) for a in (d, -128 * d))
        qw = quantize_int8(w, grid)
        assert native.is_symmetric(qw) and not native.fits_int4(qw)
        return qw
    d = rng.uniform(0.001, 0.05, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.3, 0.0, (k // 32, 1, n)).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (k // 32, 32, n))
    w = (codes * d + m).reshape(k, n).astype(np.float32)
    grid = tuple(np.broadcast_to(a, (k // 32, 32, n)).reshape(k, n) for a in (d, m))
    qw = quantize_int8(w, grid)
    assert native.fits_int4(qw)
    return qw


DIRECT_ROWS = 4  # quant_matmul.h's kQuantDirectRows


def exact(x: np.ndarray, qw: dict[str, np.ndarray]) -> np.ndarray:
    """x @ the dequantized weight, in float64."""
    return x.astype(np.float64) @ dequantize_np(qw).astype(np.float64)


def assert_products(got: np.ndarray, x: np.ndarray, qw: dict[str, np.ndarray], rtol=1e-5):
    """got is x @ w as the kernel's path for x's row count computes it. More than 4 rows:
    the dot with the dequantized weight in float32 (rtol). Up to 4 rows, the integer path:
    each activation as d (254 u + v) with d = max |a| / (127 x 254) over its group of 32,
    so off by at most d / 2 (plus float32 rounding): the products within sum_r |w_rc| x d_r
    (twice the rounding bound) of the exact ones, and no further."""
    want = exact(x, qw)
    scale = np.abs(want).max()
    if x.shape[0] > DIRECT_ROWS:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)
        return
    m, k = x.shape
    amax = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32).max(axis=2)
    step = np.repeat(amax / (127 * 254), 32, axis=1)  # d of each activation's group
    bound = step @ np.abs(dequantize_np(qw).astype(np.float64)) + 1e-5 * scale
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"max error {err.max():.3g} over the bound {bound.min():.3g}"


def kernel_for(bits: int | str):
    return native.INT4_MATMUL if bits == 4 else native.INT8_MATMUL


def test_pack_layout():
    """Block b, group g: byte 64 p + 4 c + j is q[32 g + 4 p + j, 16 b + c] (as uint8 of the
    int8), then the 16 float16 scales and the 16 float16 minimums of those columns."""
    qw = quantized(96, 48)
    packed = native.pack_int8(qw)
    assert packed.shape == (3, 3, 576) and packed.dtype == np.uint8
    rng = np.random.default_rng(1)
    for _ in range(50):
        b, g, p, j, c = (int(rng.integers(s)) for s in (3, 3, 8, 4, 16))
        got = packed[b, g, 64 * p + 4 * c + j].view(np.int8)
        assert got == qw["q"][32 * g + 4 * p + j, 16 * b + c]
        scales = packed[b, g, 512:544].view(np.float16)
        minimums = packed[b, g, 544:].view(np.float16)
        assert scales[c] == qw["scale"][g, 16 * b + c] and minimums[c] == qw["min"][g, 16 * b + c]


def test_pack_symmetric_layout():
    """Q8_0 blocks (every minimum -128 x its scale): the codes and scales as `pack_int8`'s
    asymmetric layout has them, without the minimums; the kernel reads either."""
    qw = quantized(64, 32, bits="q8_0")
    packed = native.pack_int8(qw)
    assert packed.shape == (2, 2, 544) and packed.dtype == np.uint8
    full = native.pack_int8(qw, symmetric=False)
    assert full.shape == (2, 2, 576)
    np.testing.assert_array_equal(packed, full[:, :, :544])
    assert not native.is_symmetric(quantized(64, 32))
    with pytest.raises(ValueError, match="not -128 x scale"):
        native.pack_int8(quantized(64, 32), symmetric=True)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 64)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(INT8.kernel(x, jnp.asarray(packed))),
        np.asarray(INT8.kernel(x, jnp.asarray(full))),
    )


def test_pack_int4_layout():
    """Block b, group g: byte 64 p + 4 c + j holds the codes (q + 128) of inputs 32 g + 4 p + j
    (low nibble) and 32 g + 16 + 4 p + j (high nibble) of column 16 b + c; scales and
    minimums as int8."""
    qw = quantized(64, 32, bits=4)
    packed = native.pack_int4(qw)
    assert packed.shape == (2, 2, 320) and packed.dtype == np.uint8
    codes = qw["q"].astype(np.int16) + 128
    rng = np.random.default_rng(2)
    for _ in range(50):
        b, g, p, j, c = (int(rng.integers(s)) for s in (2, 2, 4, 4, 16))
        byte = int(packed[b, g, 64 * p + 4 * c + j])
        assert byte & 15 == codes[32 * g + 4 * p + j, 16 * b + c]
        assert byte >> 4 == codes[32 * g + 16 + 4 * p + j, 16 * b + c]
    np.testing.assert_array_equal(
        packed[:, :, 256:], native.pack_int8(qw, symmetric=False)[:, :, 512:]
    )
    assert not native.fits_int4(quantized(64, 32))
    with pytest.raises(ValueError, match=r"outside 0\.\.15"):
        native.pack_int4(quantized(64, 32))


def test_pack_rejects_shapes_off_the_tiles():
    assert native.can_pack_int8((64, 48)) and not native.can_pack_int8((48, 64))
    with pytest.raises(ValueError, match="K must divide by 32"):
        native.pack_int8(quantize_int8(np.ones((40, 16), np.float32)))  # one group of 40
    with pytest.raises(ValueError, match="N by 16"):
        native.pack_int8(quantized(64, 40))


# Rows on each path: 1-4 take integer dot products, more dequantize a slice to float32;
# 130 rows at K = 2048 span several row chunks. N: whole tiles and a ragged last group.
@pytest.mark.parametrize(
    "m, k, n",
    [(1, 32, 16), (2, 64, 48), (3, 96, 80), (4, 576, 1536), (5, 64, 48), (17, 128, 208),
     (64, 512, 768), (130, 2048, 96)],
)  # fmt: skip
@pytest.mark.parametrize("bits", FORMS)
def test_matmul_is_the_dot_with_the_dequantized_weight(m, k, n, bits):
    qw = quantized(k, n, seed=m, bits=bits)
    spec = kernel_for(bits)
    x = np.random.default_rng(m + 1).standard_normal((m, k)).astype(np.float32)
    got = np.asarray(jax.jit(spec.kernel)(jnp.asarray(x), jnp.asarray(spec.pack(qw))))
    assert got.shape == (m, n) and got.dtype == np.float32
    assert_products(got, x, qw)


@pytest.mark.parametrize("m, k, i", [(1, 32, 16), (3, 64, 48), (13, 96, 64), (64, 512, 1536)])
@pytest.mark.parametrize("bits", FORMS)
def test_swiglu_is_silu_gate_times_up(m, k, i, bits):
    qw = quantized(k, 2 * i, seed=i, bits=bits)
    spec = kernel_for(bits)
    x = np.random.default_rng(i).standard_normal((m, k)).astype(np.float32)
    got = np.asarray(jax.jit(spec.swiglu)(jnp.asarray(x), jnp.asarray(spec.pack(qw))))
    gate_up = exact(x, qw)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    want = gate / (1 + np.exp(-gate)) * up
    assert got.shape == (m, i)
    # the integer path's activation codes: the matmul tests bound their error; here ~1e-4
    atol = (1e-5 if m > DIRECT_ROWS else 2e-4) * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("bits", FORMS)
def test_integer_path_extremes(bits):
    """The integer path's int16 sums at their limits: every code at its extreme (int8 -128,
    int4 15) against activations at +-max of their group (each code +-127), a group of
    zeros (d = 0), and one activation far above the rest of its group."""
    k, n = 128, 32
    codes = np.full((k, n), -128 if bits == 8 else 15 - 128, np.int8)
    qw = {
        "q": codes,
        "scale": np.full((k // 32, n), 0.01, np.float16),
        "min": np.full((k // 32, n), -0.5, np.float16),
    }
    spec = kernel_for(bits)
    x = np.ones((4, k), np.float32)
    x[0] = np.where(np.arange(k) % 2, 3.0, -3.0)
    x[1] = 7.5
    x[2, :32] = 0.0
    x[3, 5] = 1e4
    for rows in (1, 4):
        got = np.asarray(jax.jit(spec.kernel)(jnp.asarray(x[:rows]), jnp.asarray(spec.pack(qw))))
        assert_products(got, x[:rows], qw)


@pytest.mark.parametrize("rows", [0, 3, 13])
@pytest.mark.parametrize("bits", FORMS)
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


@pytest.mark.parametrize(
    "level", isa_level_params(v for v in native.supported_levels() if v != "generic")
)
@pytest.mark.parametrize("bits", FORMS)
def test_every_isa_level_gives_the_same_products(bits, level):
    """The library of each level this CPU runs (AVX2 code, AVX-512 where present)."""
    qw = quantized(128, 64, bits=bits)
    spec = kernel_for(bits)
    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    packed = spec.pack(qw)
    call = jax.ffi.ffi_call(
        native.build.registered_target(spec.matmul_target, level),
        jax.ShapeDtypeStruct((6, 64), jnp.float32),
    )
    for rows in (2, 6):  # the integer path and the dequantizing one
        real = jnp.full(1, rows, jnp.int32)
        layer = jnp.zeros(1, jnp.int32)  # (a stack of one layer: ops.layer_operands)
        got = np.asarray(call(jnp.asarray(x), jnp.asarray(packed)[None], layer, real))
        assert_products(got[:rows], x[:rows], qw)


@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("bits", FORMS)
def test_norm_fused_matmul_is_the_matmul_of_the_normed_rows(rows, bits):
    """native.packed_norm_matmul: the rows RMS-normed in the kernel's call (as
    layers.rms_norm, the norm weight float32 or bfloat16), then the same matmul / SwiGLU;
    padding rows stay zero."""
    from jaxcb.models.layers import rms_norm

    k, n = 96, 64
    qw = quantized(k, n, seed=rows, bits=bits)
    spec = kernel_for(bits)
    packed = jnp.asarray(spec.pack(qw))
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((16, k)) * 3.0, jnp.float32)
    g32 = jnp.asarray(rng.uniform(0.5, 1.5, k), jnp.float32)
    real = jnp.int32(rows)
    cases = [(g, False, spec.kernel) for g in (g32, g32.astype(jnp.bfloat16))]
    for g, swiglu, plain in [*cases, (g32, True, spec.swiglu)]:
        got = np.asarray(
            jax.jit(native.packed_norm_matmul, static_argnames=("kernel", "eps", "swiglu"))(
                x=x, weight=g, w_packed=packed, rows=real, kernel=spec.name, eps=1e-5,
                swiglu=swiglu,
            )
        )  # fmt: skip
        want = np.asarray(jax.jit(plain)(rms_norm(x, g, 1e-5), packed, real))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        assert not got[rows:].any()
