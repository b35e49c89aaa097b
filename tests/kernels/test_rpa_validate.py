"""static_validate_inputs / dynamic_validate_inputs: every bad input is a ValueError naming it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import Shape, make_batch

from pallas_kernels.ragged_paged_attention import (
    dynamic_validate_inputs,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
    static_validate_inputs,
)

SHAPE = Shape(num_q_heads=4, num_kv_heads=2)
SEQS = [(1, 17), (9, 33), (1, 1)]
NAMES = ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def batch(**replace) -> dict:
    args = dict(zip(NAMES, make_batch(SHAPE, SEQS), strict=True))
    args.update(replace)
    return args


def test_valid_batch_passes_both():
    static_validate_inputs(**batch())
    dynamic_validate_inputs(**batch())


def test_static_checks_run_on_shape_dtype_structs():
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch().items()}
    static_validate_inputs(**abstract)


STATIC_ERRORS = {
    "q_rank": (dict(q=jnp.zeros((16, 4 * 64))), "q must be"),
    "kv_heads_divide_q_heads": (
        dict(q=jnp.zeros((16, 3, 64))),
        "num_q_heads=3 must be divisible by num_kv_heads=2",
    ),
    "head_dim": (dict(q=jnp.zeros((16, 4, 32))), "head_dim=32 of q must equal"),
    "k_v_shapes": (dict(v_pages=jnp.zeros((2, 24, 8, 64))), "k_pages.shape=.* must equal"),
    "k_v_dtypes": (
        dict(v_pages=jnp.zeros((2, 24, 16, 64), jnp.bfloat16)),
        "k_pages.dtype=.* must equal",
    ),
    "k_rank": (
        dict(k_pages=jnp.zeros((24, 16, 64)), v_pages=jnp.zeros((24, 16, 64))),
        "k_pages must be",
    ),
    "int_q": (dict(q=jnp.zeros((16, 4, 64), jnp.int32)), "q must be floating point"),
    "kv_lens_dtype": (dict(kv_lens=jnp.zeros(4, jnp.float32)), "kv_lens must be int32"),
    "page_indices_rank": (dict(page_indices=jnp.zeros(16, jnp.int32)), "page_indices must have"),
    "page_indices_rows": (
        dict(page_indices=jnp.zeros((3, 4), jnp.int32)),
        r"page_indices rows \(3\) must equal len\(kv_lens\) \(4\)",
    ),
    "cu_q_lens_length": (dict(cu_q_lens=jnp.zeros(4, jnp.int32)), "must have len.* = 5 entries"),
    "num_seqs_shape": (dict(num_seqs=jnp.zeros(2, jnp.int32)), r"shape \(1,\)"),
    "num_seqs_dtype": (dict(num_seqs=jnp.zeros(1, jnp.uint32)), "num_seqs must be int32"),
}


@pytest.mark.parametrize("case", sorted(STATIC_ERRORS))
def test_static_errors(case):
    replace, message = STATIC_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        static_validate_inputs(**batch(**replace))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(sliding_window=0), "sliding_window=0"), (dict(soft_cap=-1.0), "soft_cap=-1.0")],
)
def test_static_attention_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        static_validate_inputs(**batch(), **kwargs)


@pytest.mark.parametrize("kernel", [ragged_paged_attention_tpu, ragged_paged_attention_gpu])
def test_kernels_validate_statically(kernel):
    with pytest.raises(ValueError, match="must be divisible by"):
        kernel(**batch(q=jnp.zeros((16, 3, 64))), sm_scale=1.0, interpret=True)


def i32(*values) -> jax.Array:
    return jnp.asarray(np.array(values, np.int32))


DYNAMIC_ERRORS = {
    "num_seqs_too_big": (dict(num_seqs=i32(5)), r"num_seqs=5 must be in \[0, 4\]"),
    "num_seqs_negative": (dict(num_seqs=i32(-1)), "num_seqs=-1"),
    "cu_start": (dict(cu_q_lens=i32(1, 2, 11, 12, 12)), r"cu_q_lens\[0\]=1 must be 0"),
    "cu_decreasing": (
        dict(cu_q_lens=i32(0, 9, 1, 12, 12)),
        r"non-decreasing: cu_q_lens\[1\]=9 > cu_q_lens\[2\]=1",
    ),
    "cu_past_tokens": (
        dict(cu_q_lens=i32(0, 1, 10, 17, 17)),
        r"cu_q_lens\[num_seqs\]=17 exceeds the 16",
    ),
    "q_len_over_kv_len": (
        dict(kv_lens=i32(17, 8, 1, 0)),
        r"sequence 1: q_len=9 must not exceed kv_lens\[1\]=8",
    ),
    "kv_len_over_capacity": (
        dict(kv_lens=i32(17, 65, 1, 0)),
        r"kv_lens\[1\]=65 must be in \[0, pages_per_seq \* page_size = 64\]",
    ),
}


@pytest.mark.parametrize("case", sorted(DYNAMIC_ERRORS))
def test_dynamic_errors(case):
    replace, message = DYNAMIC_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        dynamic_validate_inputs(**batch(**replace))


def test_dynamic_page_index_out_of_range():
    args = batch()
    table = np.asarray(args["page_indices"]).copy()
    table[1, 2] = 24  # sequence 1 (kv_len 33) uses 3 pages: its third is out of the pool
    with pytest.raises(ValueError, match=r"page_indices\[1, 2\]=24 is outside \[0, 24\)"):
        dynamic_validate_inputs(**batch(page_indices=jnp.asarray(table)))
    table[1, 2] = -1
    with pytest.raises(ValueError, match=r"page_indices\[1, 2\]=-1"):
        dynamic_validate_inputs(**batch(page_indices=jnp.asarray(table)))


def test_dynamic_ignores_unused_pages_and_dead_sequences():
    """Table columns past a sequence's last page and rows of dead sequences may be garbage."""
    args = batch()
    table = np.asarray(args["page_indices"]).copy()
    table[0, 2:] = -7  # sequence 0 (kv_len 17) uses 2 pages
    table[3, :] = 10**6  # sequence 3 is not live
    dynamic_validate_inputs(**batch(page_indices=jnp.asarray(table)))
