"""Quantized KV pages (int8 / fp8 values, a float32 scale per slot: kv_quant.py) through every
attention path against the reference: "xla" (the CPU path), the Pallas TPU kernel in TPU
interpret mode and the Triton kernel with interpret=True, all on CPU.

The batches are the kernel test batches of rpa_cases, quantized by `quantize_batch`: unused
pages and the tails of partly filled pages hold NaN scales (and NaN fp8 values), page tables
are shuffled. Interpret mode is slow on 2 cores: a handful of shapes (one compile each per
backend and dtype), the batch kinds varied on top.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import Shape, assert_matches_reference, make_batch, quantize_batch
from test_ragged_paged_attention import BATCHES, SMALL_BLOCKS
from test_rpa_gpu import LONG_BATCHES, LONG_BLOCKS, LONG_SHAPE

from pallas_kernels.ragged_paged_attention import (
    QUANTIZED_KV_DTYPES,
    dequantize,
    dynamic_validate_inputs,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    static_validate_inputs,
    write_kv,
)
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

STATIC = ("sm_scale", "sliding_window", "soft_cap")
reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
# Small blocks and chunks, so blocks, block groups and KV chunks all wrap several times.
xla = jax.jit(
    functools.partial(ragged_paged_attention_xla, block_q=4, kv_chunk_pages=2, block_group=2),
    static_argnames=STATIC,
)

BACKENDS = ("xla", "tpu", "gpu")
#: G = 4 query heads per KV head, head_dim 64, page size 16: one compile per backend/dtype.
SHAPE = Shape(num_q_heads=8, num_kv_heads=2, head_dim=64)


def attend(backend: str, batch, scales, **kwargs) -> jax.Array:
    if backend == "xla":
        return xla(*batch, **scales, **kwargs)
    kwargs = SMALL_BLOCKS | kwargs
    return ragged_paged_attention(*batch, backend=backend, interpret=True, **scales, **kwargs)


def check(backend: str, shape: Shape, seqs, kv_dtype: str, seed: int = 0, **kwargs) -> None:
    batch, scales = quantize_batch(make_batch(shape, seqs, seed=seed), kv_dtype)
    assert batch[1].dtype == QUANTIZED_KV_DTYPES[kv_dtype]
    kwargs.setdefault("sm_scale", shape.head_dim**-0.5)
    out = attend(backend, batch, scales, **kwargs)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    options = {k: v for k, v in kwargs.items() if k in STATIC}
    expected = reference(*batch, **options, **scales)
    assert_matches_reference(out, expected, batch, shape.dtype)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, kv_dtype, kind):
    check(backend, SHAPE, BATCHES[kind], kv_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_e5m2_with_bfloat16_queries(backend):
    """q stays bfloat16 (never cast to the page dtype); the output is bfloat16 too."""
    shape = Shape(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    check(backend, shape, BATCHES["mixed"], "fp8_e5m2", seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_and_soft_cap(backend):
    check(backend, SHAPE, BATCHES["chunked_prefill"], "int8", sliding_window=20, soft_cap=3.0)


@pytest.mark.parametrize("num_pages", [256, 300], ids=["whole_chunks", "partial_chunk"])
def test_tpu_scales_of_pages_in_every_lane_chunk(num_pages):
    """The TPU kernel reads a page's scales from the 128-page lane chunk that holds it (the
    last one narrower when num_pages is no multiple of 128); shuffled pages of a large pool
    land in every chunk."""
    shape = Shape(num_q_heads=4, num_kv_heads=1, head_dim=64, num_pages=num_pages)
    seqs = BATCHES["mixed"]
    batch, scales = quantize_batch(make_batch(shape, seqs, seed=5), "int8")
    used = np.asarray(batch[4])[: len(seqs)]
    assert used[used < num_pages].max() >= 128  # pages beyond the first chunk are read
    out = ragged_paged_attention_tpu(
        *batch, sm_scale=0.125, interpret=True, **SMALL_BLOCKS, **scales
    )
    expected = reference(*batch, sm_scale=0.125, **scales)
    assert_matches_reference(out, expected, batch, shape.dtype)


def test_gpu_split_kv():
    """Split-KV (flash-decoding) partials of quantized pages, merged."""
    batch, scales = quantize_batch(make_batch(LONG_SHAPE, LONG_BATCHES["long_decode"]), "int8")
    out = ragged_paged_attention_gpu(
        *batch, sm_scale=0.125, interpret=True, num_kv_splits=3, **LONG_BLOCKS, **scales
    )
    expected = reference(*batch, sm_scale=0.125, **scales)
    assert_matches_reference(out, expected, batch, LONG_SHAPE.dtype)


# --- the reference ------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", sorted(QUANTIZED_KV_DTYPES))
def test_reference_with_scales_is_reference_on_dequantized_pages(kv_dtype):
    """Scales given: the reference dequantizes the gathered rows (value x scale, f32)."""
    batch, scales = quantize_batch(make_batch(SHAPE, BATCHES["mixed"]), kv_dtype)
    q, k_pages, v_pages, *metadata = batch
    k_float = dequantize(k_pages, scales["k_scales"])
    v_float = dequantize(v_pages, scales["v_scales"])
    quantized = reference(*batch, sm_scale=0.125, **scales)
    dequantized = reference(q, k_float, v_float, *metadata, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(quantized), np.asarray(dequantized))


#: Bounds on |quantized - float| attention output for the mixed batch (unit-normal K/V): about
#: twice the largest seen over 4 seeds (0.015, 0.105, 0.198).
QUANTIZATION_ERROR = {"int8": 0.03, "fp8_e4m3": 0.2, "fp8_e5m2": 0.4}


@pytest.mark.parametrize("kv_dtype", sorted(QUANTIZED_KV_DTYPES))
def test_quantized_attention_is_close_to_float(kv_dtype):
    """K/V written through write_kv's quantization: the output stays near the float one."""
    batch = make_batch(SHAPE, BATCHES["mixed"])
    quantized, scales = quantize_batch(batch, kv_dtype)
    num_real = int(batch[5][int(batch[6][0])])
    exact = np.asarray(reference(*batch, sm_scale=0.125))[:num_real]
    approx = np.asarray(reference(*quantized, sm_scale=0.125, **scales))[:num_real]
    error = np.abs(approx - exact).max()
    assert 0 < error < QUANTIZATION_ERROR[kv_dtype]


# --- interface errors ---------------------------------------------------------------------


def test_quantized_pages_need_scales_everywhere():
    batch, _ = quantize_batch(make_batch(SHAPE, BATCHES["mixed"]), "int8")
    message = "int8 pages need k_scales and v_scales"
    with pytest.raises(ValueError, match=message):
        reference(*batch, sm_scale=0.125)
    with pytest.raises(ValueError, match=message):
        xla(*batch, sm_scale=0.125)
    for backend in ("tpu", "gpu"):
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention(*batch, sm_scale=0.125, backend=backend, interpret=True)
    new = jnp.zeros((4, SHAPE.num_kv_heads, SHAPE.head_dim))
    with pytest.raises(ValueError, match=message):
        write_kv(batch[1], batch[2], new, new, jnp.zeros(4, jnp.int32))


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        (dict(v_scales=None), "must be given together"),
        (
            dict(k_scales=jnp.ones((2, 24, 16), jnp.bfloat16)),
            r"k_scales must be float32\[2, 24, 16\]",
        ),
        (
            dict(v_scales=jnp.ones((2, 24, 8))),
            r"v_scales must be float32\[2, 24, 16\].*\[2, 24, 8\]",
        ),
    ],
    ids=["one_missing", "dtype", "shape"],
)
def test_bad_scales_are_value_errors(replace, message):
    batch, scales = quantize_batch(make_batch(SHAPE, BATCHES["mixed"]), "int8")
    dynamic_validate_inputs(*batch, **scales)  # the good ones pass both checks
    with pytest.raises(ValueError, match=message):
        static_validate_inputs(*batch, **(scales | replace))


def test_scales_with_float_pages_are_a_value_error():
    batch = make_batch(SHAPE, BATCHES["mixed"])
    scales = jnp.ones((2, 24, 16), jnp.float32)
    with pytest.raises(ValueError, match="k_scales/v_scales are for quantized pages"):
        static_validate_inputs(*batch, k_scales=scales, v_scales=scales)
