"""The engine's fast XLA attention against the plain-jnp reference (same batches as kernels)."""

from __future__ import annotations

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rpa_cases import Shape, assert_matches_reference, make_batch
from test_ragged_paged_attention import BATCHES

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

reference = jax.jit(
    ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "soft_cap")
)
# Small blocks and chunks so blocks, block groups and KV chunks all wrap several times.
SMALL = dict(block_q=4, kv_chunk_pages=2, block_group=2)


def check(shape: Shape, seqs, seed: int = 0, **kwargs) -> None:
    batch = make_batch(shape, seqs, seed=seed)
    kwargs.setdefault("sm_scale", shape.head_dim**-0.5)
    out = ragged_paged_attention_xla(*batch, **SMALL, **kwargs)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    assert_matches_reference(out, reference(*batch, **kwargs), batch, shape.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_batches(kind, dtype):
    check(Shape(dtype=dtype), BATCHES[kind])


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_and_head_dims(num_q_heads, num_kv_heads, head_dim):
    shape = Shape(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    check(shape, BATCHES["mixed"], seed=1)


@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (None, 3.0), (17, 2.0)])
def test_window_and_soft_cap(sliding_window, soft_cap):
    for kind in ("mixed", "chunked_prefill", "decode_long"):
        check(Shape(), BATCHES[kind], sliding_window=sliding_window, soft_cap=soft_cap)


def test_one_block_many_sequences_and_default_blocks():
    shape = Shape(num_tokens=64, max_num_seqs=16, num_pages=64, pages_per_seq=4)
    seqs = [(1, 5 + 3 * i) for i in range(10)] + [(20, 40), (7, 7), (2, 64), (1, 64)]
    check(shape, seqs, seed=3)
    batch = make_batch(shape, seqs, seed=3)
    out = ragged_paged_attention_xla(*batch, sm_scale=0.125)  # engine defaults
    assert_matches_reference(out, reference(*batch, sm_scale=0.125), batch, "float32")


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_ragged_batches(data):
    shape = Shape(num_tokens=32, max_num_seqs=6, num_pages=40, pages_per_seq=4)
    n = data.draw(st.integers(0, shape.max_num_seqs))
    seqs, tokens, pages = [], 0, 0
    for _ in range(n):
        kv_len = data.draw(st.integers(0, shape.pages_per_seq * shape.page_size))
        q_len = data.draw(st.integers(0, min(kv_len, shape.num_tokens - tokens)))
        if pages + -(-kv_len // shape.page_size) > shape.num_pages:
            break
        seqs.append((q_len, kv_len))
        tokens += q_len
        pages += -(-kv_len // shape.page_size)
    check(shape, seqs, seed=data.draw(st.integers(0, 99)))
