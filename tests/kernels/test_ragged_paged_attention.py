"""Both Pallas kernels against the plain-jnp reference, in interpret mode on CPU.

Interpret mode compiles one program per (shape, static args), so the cases below share a few
`Shape`s and block sizes: the parametrizations vary the *data* (batch kind, seed) far more
than the shapes, and every compiled kernel is reused by the jit cache.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rpa_cases import Shape, assert_matches_reference, make_batch

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
)

BACKENDS = ("tpu", "gpu")

#: (q_len, kv_len) per live sequence. Page size 16 throughout, so kv lengths 1, 15, 16, 17
#: sit on the page boundaries and 33+ span several pages.
BATCHES = {
    "decode": [(1, 1), (1, 15), (1, 16), (1, 17)],
    "decode_long": [(1, 33), (1, 64), (1, 48), (1, 2)],
    "prefill": [(3, 3), (6, 6), (7, 7)],
    "chunked_prefill": [(5, 20), (11, 64)],
    "mixed": [(1, 17), (9, 33), (1, 1), (4, 64)],
    "page_boundaries": [(1, 1), (2, 15), (3, 16), (4, 17)],
    "idle_sequence": [(0, 5), (3, 3), (0, 0)],  # live sequences with no new tokens
    "no_sequences": [],  # every row is padding
}

#: Small blocks, so sequences straddle query blocks and KV blocks, and blocks hold several
#: sequences. The GPU wrapper raises the query block to 16 rows where G is small.
SMALL_BLOCKS = dict(num_queries_per_block=8, num_kv_pages_per_block=2)

reference = jax.jit(
    ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "soft_cap")
)


def check(backend: str, shape: Shape, seqs, seed: int = 0, **kwargs) -> None:
    batch = make_batch(shape, seqs, seed=seed)
    kwargs.setdefault("sm_scale", shape.head_dim**-0.5)
    options = ("sm_scale", "sliding_window", "soft_cap")
    attention_kwargs = {k: v for k, v in kwargs.items() if k in options}
    out = ragged_paged_attention(*batch, backend=backend, interpret=True, **kwargs)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    assert_matches_reference(out, reference(*batch, **attention_kwargs), batch, shape.dtype)


@pytest.mark.parametrize("kind", sorted(BATCHES))
# MHA and GQA in CI; groups 2 and 8 (one KV head) take the same paths: --runslow.
@pytest.mark.parametrize(
    "group",
    [1, pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, group, kind):
    shape = Shape(num_q_heads=8, num_kv_heads=8 // group, head_dim=64, dtype=dtype)
    check(backend, shape, BATCHES[kind], **SMALL_BLOCKS)


@pytest.mark.parametrize("kind", ["decode_long", "prefill", "mixed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_128(backend, dtype, kind):
    shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=128, dtype=dtype)
    check(backend, shape, BATCHES[kind], **SMALL_BLOCKS)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "sliding_window", "soft_cap"),
    [(96, "float32", None, None), (96, "bfloat16", 20, None), (256, "bfloat16", 20, 3.0)],
    ids=str,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_phi3_and_gemma_head_dims(backend, head_dim, dtype, sliding_window, soft_cap):
    """Phi-3's 96 (no power of two: the GPU kernel pads it to 128) and Gemma's 256, with its
    window and soft cap."""
    shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap, **SMALL_BLOCKS)
    check(backend, shape, BATCHES["mixed"], **options)


@pytest.mark.parametrize("kind", ["decode_long", "chunked_prefill", "mixed"])
@pytest.mark.parametrize(
    ("sliding_window", "soft_cap"), [(5, None), (None, 2.0), (20, 3.0)], ids=str
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_and_soft_cap(backend, sliding_window, soft_cap, kind):
    shape = Shape(num_q_heads=4, num_kv_heads=2)
    check(
        backend,
        shape,
        BATCHES[kind],
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        **SMALL_BLOCKS,
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_block_sizes(backend, seed):
    """The tuning-table blocks: several query blocks, one KV block per short sequence."""
    shape = Shape(
        num_tokens=40,
        max_num_seqs=6,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        num_pages=40,
        pages_per_seq=6,
        dtype="bfloat16",
    )
    seqs = [(1, 90), (17, 40), (1, 3), (12, 12), (1, 96), (7, 70)]
    check(backend, shape, seqs, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_size_not_power_of_two(backend):
    """G = 3 is no power of two: the GPU kernel pads the group to 4 heads."""
    shape = Shape(num_q_heads=6, num_kv_heads=2)
    check(backend, shape, BATCHES["mixed"], **SMALL_BLOCKS)


HYPOTHESIS_SHAPE = Shape(
    num_tokens=24, max_num_seqs=5, num_q_heads=4, num_kv_heads=1, page_size=8, num_pages=40
)


@st.composite
def ragged_batches(draw, shape: Shape = HYPOTHESIS_SHAPE):
    """Random live sequences that fit the shape's tokens; kv_len >= q_len, often a decode."""
    max_kv = shape.pages_per_seq * shape.page_size
    seqs, tokens_left = [], shape.num_tokens
    for _ in range(draw(st.integers(0, shape.max_num_seqs))):
        kv_len = draw(st.integers(1, max_kv))
        q_len = draw(st.sampled_from([1, 1, min(kv_len, tokens_left), None]))
        if q_len is None:
            q_len = draw(st.integers(0, min(kv_len, tokens_left)))
        q_len = min(q_len, tokens_left)
        tokens_left -= q_len
        seqs.append((q_len, kv_len))
    return seqs


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(seqs=ragged_batches(), seed=st.integers(0, 2**16))
def test_random_ragged_batches(backend, seqs, seed):
    check(backend, HYPOTHESIS_SHAPE, seqs, seed=seed, num_queries_per_block=8)


def test_dispatcher_rejects_unknown_backend():
    batch = make_batch(Shape(), BATCHES["mixed"])
    with pytest.raises(ValueError, match="backend="):
        ragged_paged_attention(*batch, sm_scale=1.0, backend="cuda")


@pytest.mark.parametrize(
    ("kernel", "blocks"),
    [
        (ragged_paged_attention_gpu, dict(num_kv_pages_per_block=3)),
        (ragged_paged_attention_gpu, dict(num_queries_per_block=24)),
        (ragged_paged_attention_tpu, dict(num_queries_per_block=-8)),
    ],
)
def test_bad_block_sizes_are_value_errors(kernel, blocks):
    batch = make_batch(Shape(), BATCHES["mixed"])
    with pytest.raises(ValueError, match="must be"):
        kernel(*batch, sm_scale=1.0, interpret=True, **blocks)


def test_dispatch_matches_direct_call():
    shape = Shape(num_q_heads=8, num_kv_heads=4)
    batch = make_batch(shape, BATCHES["mixed"])
    direct = functools.partial(ragged_paged_attention_tpu, sm_scale=0.125, interpret=True)
    via = ragged_paged_attention(*batch, sm_scale=0.125, backend="tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(direct(*batch)), np.asarray(via))


#: Many sequences x many pages: page-table rows span several of the 128-id chunks the TPU
#: kernel copies per KV block (its table stays in HBM), and the long sequences' KV blocks
#: take their ids from the later chunks. Page size 4 keeps the pool small.
LARGE_TABLE_SHAPE = Shape(
    num_tokens=64,
    max_num_seqs=40,
    num_q_heads=4,
    num_kv_heads=2,
    page_size=4,
    num_pages=1200,
    pages_per_seq=400,
)


@pytest.mark.parametrize(
    "pages_per_block",
    [pytest.param(None, marks=pytest.mark.slow), 3],  # (3 pages a block: more table chunks)
    ids=["default_blocks", "3_pages"],
)
def test_tpu_large_page_table(pages_per_block):
    """3 pages per block: a chunk is lcm(128, 3) = 384 ids; the default (32 pages): 128.
    (The 3-page case, ~10x the KV blocks in interpret mode, takes the longest sequence only.)"""
    rng = np.random.default_rng(7)
    seqs = [(1, 1590), (4, 4)]
    if pages_per_block is None:
        seqs[1:1] = [(9, 1000), (1, 513)]
        seqs += [(1, int(kv)) for kv in rng.integers(1, 60, LARGE_TABLE_SHAPE.max_num_seqs - 4)]
    check("tpu", LARGE_TABLE_SHAPE, seqs, num_kv_pages_per_block=pages_per_block)
