"""The native CPU kernels over quantized KV pages (int8, float8_e4m3fn, float8_e5m2 codes with a
float32 scale per head, page and slot): attention against the plain-jnp reference at every ISA
level this CPU runs (head_dim 64, 96, 128 and 256 take the vector routines, 32 the scalar
one), the quantized KV write against the jnp write, and the bit-for-bit row copy a swap-in uses.

The batches are rpa_cases' with their pages quantized (`quantize_batch`): slots no sequence
uses hold a NaN scale, so a kernel that reads one poisons its output."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import isa_level_params
from rpa_cases import Shape, assert_matches_reference, make_batch, quantize_batch
from test_ragged_paged_attention import BATCHES

from jaxcb import native
from pallas_kernels.ragged_paged_attention import (
    PADDING_SLOT,
    QMAX,
    QUANTIZED_KV_DTYPES,
    ragged_paged_attention_reference,
    write_kv,
)

STATIC = ("sm_scale", "sliding_window", "soft_cap")
reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler")
LEVELS = native.supported_levels()
KERNELS = {
    level: jax.jit(
        functools.partial(native.ragged_paged_attention_native, level=level),
        static_argnames=STATIC,
    )
    for level in LEVELS
}
KV_DTYPES = sorted(QUANTIZED_KV_DTYPES)  # fp8_e4m3, fp8_e5m2, int8
levels = pytest.mark.parametrize("level", isa_level_params(LEVELS))
kv_dtypes = pytest.mark.parametrize("kv_dtype", KV_DTYPES)


def check(level: str, kv_dtype: str, shape: Shape, seqs, seed: int = 0, **kwargs) -> None:
    batch, scales = quantize_batch(make_batch(shape, seqs, seed=seed), kv_dtype)
    kwargs.setdefault("sm_scale", shape.head_dim**-0.5)
    out = KERNELS[level](*batch, **kwargs, **scales)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    # The reference dequantizes each row (value x scale in float32), as the kernels do.
    expected = reference(*batch, **kwargs, **scales)
    assert_matches_reference(out, expected, batch, shape.dtype)


def _kind_and_head_dim() -> list:
    """Every batch kind at head_dim 64; 128 and 32 (other instantiations of the same kernel)
    on the mixed batch in CI, on every kind with --runslow."""
    return [
        pytest.param(
            kind,
            head_dim,
            marks=[] if head_dim == 64 or kind == "mixed" else [pytest.mark.slow],
            id=f"{head_dim}-{kind}",
        )
        for head_dim in (64, 128, 32)
        for kind in sorted(BATCHES)
    ]


@levels
@kv_dtypes
@pytest.mark.parametrize("kind, head_dim", _kind_and_head_dim())
def test_batches(level, kv_dtype, kind, head_dim):
    check(level, kv_dtype, Shape(head_dim=head_dim), BATCHES[kind])


@levels
@kv_dtypes
@pytest.mark.parametrize("head_dim", [96, 256])
def test_phi3_and_gemma_head_dims(level, kv_dtype, head_dim):
    """Phi-3's 96 and Gemma's 256 (with its window and soft cap): decode rows, a prefill
    block (query rows in the lanes) and a decode over two chunks."""
    shape = Shape(head_dim=head_dim, num_tokens=24, num_pages=40, pages_per_seq=20)
    options = dict(sliding_window=17, soft_cap=2.0) if head_dim == 256 else {}
    for seqs in (BATCHES["mixed"], [(20, 300), (1, 280)]):
        check(level, kv_dtype, shape, seqs, **options)


@levels
@kv_dtypes
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_gqa(level, kv_dtype, num_q_heads, num_kv_heads):
    shape = Shape(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    check(level, kv_dtype, shape, BATCHES["mixed"], seed=1)


@levels
@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (17, 2.0)])
def test_window_and_soft_cap(level, sliding_window, soft_cap):
    for kv_dtype, kind in zip(KV_DTYPES, ("mixed", "chunked_prefill", "decode_long"), strict=True):
        shape = Shape()
        check(
            level, kv_dtype, shape, BATCHES[kind], sliding_window=sliding_window, soft_cap=soft_cap
        )


@levels
@kv_dtypes
def test_contexts_longer_than_a_kv_chunk(level, kv_dtype):
    """Decode rows (scores row by row) and a prefill block (query rows in the vector lanes)
    over several 256-key chunks."""
    shape = Shape(num_tokens=32, num_pages=112, pages_per_seq=40)
    check(level, kv_dtype, shape, [(1, 600), (20, 530), (1, 257), (3, 300)], sliding_window=300)


@levels
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e5m2"])
def test_bfloat16_queries(level, kv_dtype):
    """q stays in the model's dtype: a bfloat16 q against quantized pages."""
    shape = Shape(dtype="bfloat16")
    check(level, kv_dtype, shape, BATCHES["mixed"], seed=2)


@levels
@kv_dtypes
def test_close_to_float_pages(level, kv_dtype):
    """Quantized pages change the output by about their rounding: int8 (half a step of
    max|x| / 127 a value) and e4m3 (3 mantissa bits) closely, e5m2 (2 bits) less so."""
    batch = make_batch(Shape(), BATCHES["mixed"], seed=4)
    quantized, scales = quantize_batch(batch, kv_dtype)
    n = int(batch[5][int(batch[6][0])])
    got = np.asarray(KERNELS[level](*quantized, sm_scale=0.125, **scales))[:n]
    want = np.asarray(reference(*batch, sm_scale=0.125))[:n]
    rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert rms < {"int8": 0.01, "fp8_e4m3": 0.05, "fp8_e5m2": 0.1}[kv_dtype], rms


def test_scales_must_come_with_quantized_pages_only():
    batch = make_batch(Shape(), BATCHES["decode"])
    quantized, scales = quantize_batch(batch, "int8")
    with pytest.raises(ValueError, match="int8 K/V pages take their k_scales and v_scales"):
        native.ragged_paged_attention_native(*quantized, sm_scale=0.1)
    with pytest.raises(ValueError, match="float32 K/V pages take no scales"):
        native.ragged_paged_attention_native(*batch, sm_scale=0.1, **scales)
    with pytest.raises(ValueError, match="scales must be shaped"):
        bad = {k: v[:, :-1] for k, v in scales.items()}
        native.ragged_paged_attention_native(*quantized, sm_scale=0.1, **bad)


def write_case(kv_dtype: str, new_dtype: str = "float32", seed: int = 0):
    """A quantized pool with some slots written already, and a step's new rows: every
    magnitude from 1e-30 to 1e30 (tiny rows quantize to subnormal codes), an all-zero row,
    and padding / out-of-range slots among the real ones."""
    rng = np.random.default_rng(seed)
    heads, pages, page_size, head_dim = 2, 6, 4, 64
    dtype = QUANTIZED_KV_DTYPES[kv_dtype]
    pool = rng.standard_normal((heads, pages, page_size, head_dim)).astype(np.float32)
    k_pages = jnp.asarray(pool).astype(dtype)
    v_pages = jnp.asarray(-pool).astype(dtype)
    k_scales = jnp.asarray(rng.uniform(0.01, 1, (heads, pages, page_size)), jnp.float32)
    v_scales = jnp.asarray(rng.uniform(0.01, 1, (heads, pages, page_size)), jnp.float32)
    slots = np.array([3, 17, PADDING_SLOT, 0, 23, -1, 24, 8, 9, 11], np.int32)
    magnitude = 10.0 ** rng.uniform(-30, 30, (len(slots), heads, 1))
    k = rng.standard_normal((len(slots), heads, head_dim)) * magnitude
    v = rng.standard_normal((len(slots), heads, head_dim)) * rng.exponential(1, (1, 1, head_dim))
    k[0, 1] = 0.0  # scale 1, codes 0
    v[7, 0, :3] = [1e-40, -1e-38, 0.0]  # subnormal float32 inputs
    new = (jnp.asarray(k, new_dtype), jnp.asarray(v, new_dtype))
    return (k_pages, v_pages, *new, jnp.asarray(slots)), dict(k_scales=k_scales, v_scales=v_scales)


def signed_codes(values: np.ndarray) -> np.ndarray:
    """Codes in the order of their values (int8 as they are; a float8 byte's magnitude bits
    with its sign): neighbouring values are neighbouring integers, +0 and -0 both 0."""
    if values.dtype == np.int8:
        return values.astype(np.int64)
    bits = np.ascontiguousarray(values).view(np.uint8).astype(np.int64)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)


@kv_dtypes
@pytest.mark.parametrize("new_dtype", ["float32", "bfloat16"])
def test_native_quantized_write_matches_the_jnp_write(kv_dtype, new_dtype):
    args, scales = write_case(kv_dtype, new_dtype)
    expected = write_kv(*args, **scales)
    donated = jax.jit(native.write_kv_native, donate_argnums=(0, 1, 5, 6))
    got = donated(*[jnp.array(x) for x in args], **{k: jnp.array(v) for k, v in scales.items()})
    assert len(got) == len(expected) == 4
    for e, g in zip(expected[:2], got[:2], strict=True):  # codes: within one step
        assert g.dtype == e.dtype
        diff = np.abs(signed_codes(np.asarray(g)) - signed_codes(np.asarray(e)))
        assert diff.max() <= 1, diff.max()
    for e, g in zip(expected[2:], got[2:], strict=True):  # scales: max|x| / QMAX alike
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6)
    # The untouched slots kept their codes and scales; an all-zero row has scale 1.
    written = {3, 17, 0, 23, 8, 9, 11}
    kept = [s for s in range(24) if s not in written]
    for before, after in zip((*args[:2], *scales.values()), got, strict=True):
        after, before = (np.asarray(x).reshape(2, 24, -1)[:, kept] for x in (after, before))
        np.testing.assert_array_equal(after.view(np.uint8), before.view(np.uint8))
    assert float(got[2][1, 0, 3]) == 1.0  # slot 3 = page 0, offset 3: token 0, head 1


@kv_dtypes
def test_native_write_rows_reach_qmax(kv_dtype):
    """Each row's largest magnitude is stored as QMAX exactly, so dequantized it is max|x|
    up to the scale's float32 rounding."""
    args, scales = write_case(kv_dtype, seed=1)
    k_pages, _, k_scales, _ = native.write_kv_native(*args, **scales)
    dtype = QUANTIZED_KV_DTYPES[kv_dtype]
    codes = np.asarray(k_pages.astype(jnp.float32)).reshape(2, 24, -1)
    slots, k = np.asarray(args[4]), np.asarray(args[2].astype(jnp.float32))
    stored = np.asarray(k_scales).reshape(2, 24)
    for t, slot in enumerate(slots):
        if not 0 <= slot < 24:
            continue
        amax = np.abs(k[t]).max(axis=-1)  # [heads]
        row_max = np.abs(codes[:, slot]).max(axis=-1)
        np.testing.assert_array_equal(row_max, np.where(amax > 0, QMAX[dtype], 0))
        want = np.where(amax > 0, amax / QMAX[dtype], 1.0)  # an all-zero row: scale 1
        np.testing.assert_allclose(stored[:, slot], want, rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_native_copy_puts_rows_back_bit_for_bit(kv_dtype):
    """A swap-in's copy: codes and scales of the pool's own dtype, in place, padding and
    out-of-range slots written nowhere."""
    args, scales = write_case(kv_dtype)
    k_pages, _, _, _, slots = args
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.standard_normal((len(slots), 2, 64))).astype(k_pages.dtype)
    scale_rows = jnp.asarray(rng.uniform(size=(len(slots), 2)), jnp.float32)
    copy = jax.jit(native.copy_kv_native, donate_argnums=(0, 1))
    for pool, new in ((k_pages, rows), (scales["k_scales"], scale_rows)):
        got, _ = copy(jnp.array(pool), jnp.array(pool), new, new, slots)
        want = np.asarray(pool).reshape(2, 24, -1).copy()
        real = (np.asarray(slots) >= 0) & (np.asarray(slots) < 24)
        want[:, np.asarray(slots)[real]] = (
            np.asarray(new).reshape(len(slots), 2, -1)[real].swapaxes(0, 1)
        )
        np.testing.assert_array_equal(
            np.asarray(got).reshape(want.shape).view(np.uint8), want.view(np.uint8)
        )
