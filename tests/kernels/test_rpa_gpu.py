"""The Triton kernel's own features, in interpret mode on CPU: head_dims that are no power of
two (padded inside the kernel), split-KV (flash-decoding) and its rule, the tuning table's
shared-memory fit, and the cost estimate it declares.

Shapes are small (interpret mode runs the kernel body in Python-level loops): the split-KV
cases use 16-token KV blocks so a 500-token context spans 32 of them.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from rpa_cases import Shape, assert_matches_reference, make_batch
from test_ragged_paged_attention import BATCHES, SMALL_BLOCKS, reference

from pallas_kernels.gpu_targets import H100_SXM_TARGET_CONFIG, target_config_field
from pallas_kernels.ragged_paged_attention import (
    GPU_TILES,
    gpu_block_sizes,
    gpu_num_kv_splits,
    gpu_shared_memory_bytes,
    ragged_paged_attention_gpu,
)
from pallas_kernels.ragged_paged_attention.gpu import attention_cost_estimate
from pallas_kernels.ragged_paged_attention.tuning import (
    H100_NUM_SMS,
    H100_SHARED_MEMORY_PER_BLOCK,
    MAX_KV_SPLITS,
    padded_head_dim,
)


def run(shape: Shape, seqs, seed: int = 0, **kwargs) -> tuple[jax.Array, tuple]:
    batch = make_batch(shape, seqs, seed=seed)
    kwargs.setdefault("sm_scale", shape.head_dim**-0.5)
    return ragged_paged_attention_gpu(*batch, interpret=True, **kwargs), batch


def check(shape: Shape, seqs, seed: int = 0, **kwargs) -> jax.Array:
    out, batch = run(shape, seqs, seed, **kwargs)
    options = {k: v for k, v in kwargs.items() if k in ("sliding_window", "soft_cap")}
    expected = reference(*batch, sm_scale=shape.head_dim**-0.5, **options)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    assert_matches_reference(out, expected, batch, shape.dtype)
    return out


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(80, "float32"), (96, "bfloat16"), (256, "bfloat16")]
)
def test_head_dim_not_a_power_of_two_or_large(head_dim, dtype, kind):
    """Phi-2's 80 and Phi-3's 96 pad to 128 inside the kernel; 256 (Gemma) is the largest."""
    shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    check(shape, BATCHES[kind], **SMALL_BLOCKS)


#: Few sequences with long contexts: the decode split-KV is for. T = S, so a decode bucket.
LONG_SHAPE = Shape(num_tokens=4, num_q_heads=8, num_kv_heads=2, num_pages=72, pages_per_seq=32)
LONG_BATCHES = {
    "long_decode": [(1, 500), (1, 311), (1, 129)],
    "long_and_short": [(1, 512), (1, 3), (1, 17), (1, 250)],  # most splits of short ones idle
    "long_prefill_chunk": [(3, 400), (1, 97)],
}
LONG_BLOCKS = dict(num_queries_per_block=4, num_kv_pages_per_block=1)  # G = 4: 16 rows


@pytest.mark.parametrize("kind", sorted(LONG_BATCHES))
@pytest.mark.parametrize(
    ("num_kv_splits", "dtype"), [(3, "float32"), (16, "float32"), (16, "bfloat16")]
)
def test_split_kv_matches_reference_and_unsplit(num_kv_splits, dtype, kind):
    shape = LONG_SHAPE if dtype == "float32" else Shape(**{**vars(LONG_SHAPE), "dtype": dtype})
    split = check(shape, LONG_BATCHES[kind], num_kv_splits=num_kv_splits, **LONG_BLOCKS)
    unsplit, _ = run(shape, LONG_BATCHES[kind], num_kv_splits=1, **LONG_BLOCKS)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=1e-2, rtol=2e-2)
    np.testing.assert_allclose(
        np.asarray(split, np.float32), np.asarray(unsplit, np.float32), **tolerance
    )


@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(100, None), (37, 5.0)], ids=str)
def test_split_kv_with_sliding_window_and_soft_cap(sliding_window, soft_cap):
    check(
        LONG_SHAPE,
        LONG_BATCHES["long_prefill_chunk"],
        num_kv_splits=5,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        **LONG_BLOCKS,
    )


def pallas_call_params(shape: Shape, **kwargs) -> dict:
    """The params of the one pallas_call in the traced kernel (inside its jit)."""
    batch = make_batch(shape, [])
    found = []

    def visit(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn.params)
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    visit(inner)

    kernel = ragged_paged_attention_gpu
    visit(jax.make_jaxpr(lambda *a: kernel(*a, sm_scale=1.0, interpret=True, **kwargs))(*batch))
    (params,) = found
    return params


def pallas_grid(shape: Shape, **kwargs) -> tuple[int, ...]:
    return pallas_call_params(shape, **kwargs)["grid_mapping"].grid


def test_rule_splits_a_long_few_sequence_decode_and_matches():
    """No num_kv_splits given: the rule splits this decode (2 programs, 32 KV blocks each)."""
    grid = pallas_grid(LONG_SHAPE, **LONG_BLOCKS)
    assert grid == (1, 2, 8)  # one query block, 2 KV heads, 32 KV blocks / 4 per split
    check(LONG_SHAPE, LONG_BATCHES["long_decode"], **LONG_BLOCKS)


def test_rule_does_not_split_a_large_grid():
    assert gpu_num_kv_splits(num_q_blocks=128, num_kv_heads=8, max_kv_blocks=128) == 1
    # Llama-3-8B decode of 16 sequences at 8192 tokens: 4 query blocks x 8 KV heads = 32
    # programs, far below 4 per SM; 128 KV blocks allow the cap of 16 splits.
    assert gpu_num_kv_splits(num_q_blocks=4, num_kv_heads=8, max_kv_blocks=128) == MAX_KV_SPLITS
    # A short max context caps the splits at one per 4 KV blocks.
    assert gpu_num_kv_splits(num_q_blocks=4, num_kv_heads=8, max_kv_blocks=10) == 2


def test_bad_split_count_is_a_value_error():
    with pytest.raises(ValueError, match="num_kv_splits=0 must be positive"):
        run(LONG_SHAPE, LONG_BATCHES["long_decode"], num_kv_splits=0)


# --- the tuning table ---------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_every_table_choice_fits_h100_shared_memory(head_dim, page_size, itemsize):
    """Every table entry (and what it becomes for each G, page size and dtype) fits."""
    if (head_dim, page_size, itemsize) == (256, 128, 4):
        pytest.skip("one f32 page of 128 x 256 cannot fit: test_no_fit_is_a_value_error")
    dims = {padded_head_dim(head_dim)}
    assert dims <= set(GPU_TILES)
    for group in (1, 2, 3, 4, 8, 16):
        for num_tokens, max_num_seqs in ((16, 16), (256, 256), (2048, 256)):
            blocks = gpu_block_sizes(
                head_dim=head_dim,
                page_size=page_size,
                num_q_heads=8 * group,
                num_kv_heads=8,
                num_tokens=num_tokens,
                max_num_seqs=max_num_seqs,
                pages_per_seq=8192 // page_size,
                itemsize=itemsize,
            )
            rows = blocks.num_queries_per_block * (1 << (group - 1).bit_length())
            kv_tokens = blocks.num_kv_pages_per_block * page_size
            for size in (max(rows, 16), kv_tokens):
                assert size >= 16 and size & (size - 1) == 0, (group, blocks)
            smem = gpu_shared_memory_bytes(
                head_dim=head_dim,
                query_rows=max(rows, 16),
                kv_tokens=kv_tokens,
                itemsize=itemsize,
                num_stages=blocks.num_stages,
            )
            assert smem <= H100_SHARED_MEMORY_PER_BLOCK, (group, num_tokens, blocks, smem)


def test_tuning_constants_are_the_h100_spec():
    """The table is tuned against the same numbers the compiler reads from XLA's H100 spec."""
    spec = H100_SXM_TARGET_CONFIG
    assert target_config_field(spec, "shared_memory_per_block_optin") == (
        H100_SHARED_MEMORY_PER_BLOCK
    )
    assert target_config_field(spec, "core_count") == H100_NUM_SMS
    with pytest.raises(ValueError, match="no numeric field 'sm_count'"):
        target_config_field(spec, "sm_count")


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("head_dim", sorted(GPU_TILES))
def test_table_entries_fit_as_written(head_dim, kind):
    tile = GPU_TILES[head_dim][kind]
    for itemsize in (2, 4):
        smem = gpu_shared_memory_bytes(
            head_dim=head_dim,
            query_rows=tile.query_rows,
            kv_tokens=tile.kv_tokens,
            itemsize=itemsize,
            num_stages=tile.num_stages,
        )
        assert smem <= H100_SHARED_MEMORY_PER_BLOCK


#: (head_dim, query_rows, kv_tokens, itemsize) -> shared memory bytes that XLA's Triton
#: allocated for the kernel, compiled for H100 (tests/kernels/test_rpa_gpu_compile.py
#: re-measures these where jax[cuda12] is installed).
MEASURED_SHARED_MEMORY = {
    (128, 64, 64, 2): 49152,
    (128, 64, 128, 2): 81920,
    (128, 16, 64, 2): 22528,
    (128, 32, 64, 2): 28672,
    (128, 128, 64, 2): 65536,
    (64, 16, 128, 2): 22528,
    (256, 16, 32, 2): 25600,
    (256, 64, 32, 2): 65536,
    (256, 128, 256, 2): 327680,
    # float32: full-precision dots (no tensor cores), re-measured 2026-11-26
    (128, 16, 64, 4): 77888,
    (128, 64, 64, 4): 114944,
    (64, 64, 64, 4): 65536,
    (64, 128, 32, 4): 66048,
}


@pytest.mark.parametrize("key", sorted(MEASURED_SHARED_MEMORY), ids=str)
def test_shared_memory_estimate_matches_h100_compiles(key):
    head_dim, rows, kv_tokens, itemsize = key
    for num_stages in (1, 3):  # measured: the stage count changes nothing for this kernel
        estimate = gpu_shared_memory_bytes(
            head_dim=head_dim,
            query_rows=rows,
            kv_tokens=kv_tokens,
            itemsize=itemsize,
            num_stages=num_stages,
        )
        measured = MEASURED_SHARED_MEMORY[key]
        if itemsize == 4:  # an upper bound by at most the reduction scratch's row vector
            assert measured <= estimate <= measured + rows * 4
        else:
            assert estimate == measured


def test_table_picks_for_llama_8b_buckets():
    """What the H100 preset's buckets get (Llama-3-8B: 32 / 8 heads, head_dim 128, bf16)."""
    common = dict(head_dim=128, page_size=16, num_q_heads=32, num_kv_heads=8, itemsize=2)
    common |= dict(pages_per_seq=512)
    decode = gpu_block_sizes(num_tokens=16, max_num_seqs=16, **common)
    assert (decode.num_queries_per_block, decode.num_kv_pages_per_block) == (4, 4)
    assert decode.num_kv_splits == MAX_KV_SPLITS  # 4 x 8 programs: split 16 ways
    big_decode = gpu_block_sizes(num_tokens=256, max_num_seqs=256, **common)
    assert big_decode.num_kv_splits == 2  # 64 x 8 = 512 programs < 4 x 132
    prefill = gpu_block_sizes(num_tokens=2048, max_num_seqs=256, **common)
    assert (prefill.num_queries_per_block, prefill.num_kv_splits) == (16, 1)


def test_no_fit_is_a_value_error():
    """f32 K/V at head_dim 256 in 128-token pages: one page is 128 KiB, two tiles overflow."""
    with pytest.raises(ValueError, match="no GPU tile fits 232448 bytes"):
        gpu_block_sizes(
            head_dim=256,
            page_size=128,
            num_q_heads=8,
            num_kv_heads=8,
            num_tokens=16,
            max_num_seqs=16,
            pages_per_seq=8,
            itemsize=4,
        )


def test_head_dim_beyond_the_table_is_a_value_error():
    with pytest.raises(ValueError, match="head_dim=320 exceeds"):
        gpu_block_sizes(
            head_dim=320,
            page_size=16,
            num_q_heads=8,
            num_kv_heads=8,
            num_tokens=16,
            max_num_seqs=16,
            pages_per_seq=8,
            itemsize=2,
        )


# --- cost estimate ------------------------------------------------------------------------


def test_cost_estimate_is_declared_on_the_pallas_call():
    shape = Shape(num_tokens=16, max_num_seqs=16, num_q_heads=8, num_kv_heads=2, head_dim=96)
    params = pallas_call_params(shape)
    cost = params["cost_estimate"]
    # Full pool: min(24 pages x 16, 16 seqs x 4 pages x 16) = 384 live tokens per KV head,
    # 24 keys per query token; 16 tokens x 8 heads x 24 keys = 3072 scores.
    assert cost.transcendentals == 3072
    assert cost.flops == 4 * 96 * 3072
    kv_bytes = 2 * 2 * 384 * 96 * 4
    assert cost.bytes_accessed >= kv_bytes + 2 * 16 * 8 * 96 * 4
    assert cost == attention_cost_estimate(
        num_tokens=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=96,
        max_num_seqs=16,
        pages_per_seq=4,
        num_pages=24,
        page_size=16,
        q_itemsize=4,
        kv_itemsize=4,
        num_kv_splits=params["grid_mapping"].grid[2],
    )


def test_cost_estimate_counts_split_partials_and_soft_cap():
    base = dict(
        num_tokens=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_num_seqs=16,
        pages_per_seq=512,
        num_pages=20000,
        page_size=16,
        q_itemsize=2,
        kv_itemsize=2,
    )
    plain = attention_cost_estimate(**base)
    split = attention_cost_estimate(**base, num_kv_splits=16)
    capped = attention_cost_estimate(**base, soft_cap=True)
    assert split.bytes_accessed - plain.bytes_accessed == 2 * 16 * 16 * 32 * 129 * 4
    assert capped.transcendentals == 2 * plain.transcendentals
    assert split.flops == plain.flops == capped.flops
    # 16 sequences of 8192 tokens (the pool holds more): K and V read once per KV head.
    assert plain.bytes_accessed > 2 * 8 * 16 * 8192 * 128 * 2
    assert plain.flops == 4 * 128 * 16 * 32 * 8192
