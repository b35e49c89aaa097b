"""The engine's two CPU attention paths against the plain-jnp reference, on the kernel test
batches: "xla" (pallas_kernels/ragged_paged_attention/xla.py) and "native" (jaxcb's C++ FFI
kernels, skipped where no C++ compiler is found). Also the native in-place KV write."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import isa_level_params
from hypothesis import given, settings
from hypothesis import strategies as st
from rpa_cases import Shape, assert_matches_reference, make_batch
from test_ragged_paged_attention import BATCHES

from jaxcb import native
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference, write_kv
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

STATIC = ("sm_scale", "sliding_window", "soft_cap")
reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
needs_native = pytest.mark.skipif(not native.available(), reason="no C++ compiler")

#: Every ISA level this CPU runs has its own attention code (generic C++, AVX2, AVX-512, the
#: AVX512-BF16 dot products): "native-<level>" runs that level's library, "native" the active one.
LEVELS = native.supported_levels()
BACKENDS = {
    # Small blocks and chunks so blocks, block groups and KV chunks all wrap several times.
    "xla": jax.jit(
        functools.partial(ragged_paged_attention_xla, block_q=4, kv_chunk_pages=2, block_group=2),
        static_argnames=STATIC,
    ),
    "native": jax.jit(native.ragged_paged_attention_native, static_argnames=STATIC),
    **{
        f"native-{level}": jax.jit(
            functools.partial(native.ragged_paged_attention_native, level=level),
            static_argnames=STATIC,
        )
        for level in LEVELS
    },
}
backends = pytest.mark.parametrize(
    "backend",
    [
        "xla",
        *(
            pytest.param(f"native-{p.values[0]}", marks=p.marks)
            for p in isa_level_params(LEVELS, needs_native)
        ),
    ],
)


def check(backend: str, shape: Shape, seqs, seed: int = 0, **kwargs) -> None:
    batch = make_batch(shape, seqs, seed=seed)
    kwargs.setdefault("sm_scale", shape.head_dim**-0.5)
    out = BACKENDS[backend](*batch, **kwargs)
    assert out.shape == batch[0].shape and out.dtype == batch[0].dtype
    assert_matches_reference(out, reference(*batch, **kwargs), batch, shape.dtype)


#: The batch kinds every ISA level runs (the levels helpers.isa_level_params runs by default
#: in CI); the rest run on XLA and the level this CPU uses (the other levels' libraries are
#: the same code at other vector widths: --runslow).
EVERY_LEVEL_KINDS = ("mixed", "page_boundaries")


def _batch_params() -> list:
    params = []
    levels = {f"native-{p.values[0]}": list(p.marks) for p in isa_level_params(LEVELS)}
    for backend in ["xla", *levels]:
        for kind in sorted(BATCHES):
            marks = [] if backend == "xla" else [needs_native, *levels[backend]]
            other_level = backend not in ("xla", f"native-{native.active_level()}")
            if other_level and kind not in EVERY_LEVEL_KINDS and not levels[backend]:
                marks.append(pytest.mark.slow)
            params.append(pytest.param(backend, kind, marks=marks, id=f"{kind}-{backend}"))
    return params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend, kind", _batch_params())
def test_batches(backend, kind, dtype):
    check(backend, Shape(dtype=dtype), BATCHES[kind])


@backends
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim, dtype", [(64, "float32"), (128, "bfloat16")])
def test_gqa_and_head_dims(backend, num_q_heads, num_kv_heads, head_dim, dtype):
    shape = Shape(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    check(backend, shape, BATCHES["mixed"], seed=1)


@backends
@pytest.mark.parametrize(
    "head_dim, dtype, sliding_window, soft_cap",
    [(96, "float32", None, None), (96, "bfloat16", 17, None), (256, "bfloat16", 17, 2.0)],
)
def test_phi3_and_gemma_head_dims(backend, head_dim, dtype, sliding_window, soft_cap):
    """Phi-3's 96 (six 16-lane vectors: not a multiple of AVX-512's 4-vector V slice) and
    Gemma's 256 (with its window and soft cap) take the native vector routines too: decode
    rows, a prefill block (16+ query rows: rows in the lanes) and a decode over two chunks."""
    shape = Shape(head_dim=head_dim, dtype=dtype, num_tokens=24, num_pages=40, pages_per_seq=20)
    for seqs in (BATCHES["mixed"], BATCHES["chunked_prefill"], [(20, 300), (1, 280)]):
        check(backend, shape, seqs, sliding_window=sliding_window, soft_cap=soft_cap)


@backends
@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (None, 3.0), (17, 2.0)])
def test_window_and_soft_cap(backend, sliding_window, soft_cap):
    for kind in ("mixed", "chunked_prefill", "decode_long"):
        check(backend, Shape(), BATCHES[kind], sliding_window=sliding_window, soft_cap=soft_cap)


@backends
def test_one_block_many_sequences(backend):
    shape = Shape(num_tokens=64, max_num_seqs=16, num_pages=64, pages_per_seq=4)
    seqs = [(1, 5 + 3 * i) for i in range(10)] + [(20, 40), (7, 7), (2, 64), (1, 64)]
    check(backend, shape, seqs, seed=3)


@backends
@pytest.mark.parametrize("sliding_window", [None, 300])
def test_contexts_longer_than_a_kv_chunk(backend, sliding_window):
    """Past 256 keys the native kernels update the softmax chunk by chunk: decode rows and a
    prefill block (query rows in the vector lanes) over several chunks, a window inside them."""
    shape = Shape(num_tokens=32, num_pages=112, pages_per_seq=40)
    check(backend, shape, [(1, 600), (20, 530), (1, 257), (3, 300)], sliding_window=sliding_window)


@backends
@pytest.mark.parametrize("seqs", [[(1, 9)], []])
def test_one_token_batch(backend, seqs):
    """A one-row bucket (the XLA matmul path's single stream): no room for a prefill block."""
    check(backend, Shape(num_tokens=1, max_num_seqs=1), seqs)


def test_xla_default_blocks():
    shape = Shape(num_tokens=64, max_num_seqs=16, num_pages=64, pages_per_seq=4)
    batch = make_batch(shape, [(1, 9), (20, 40), (7, 7), (1, 64)], seed=3)
    out = ragged_paged_attention_xla(*batch, sm_scale=0.125)  # the engine's block sizes
    assert_matches_reference(out, reference(*batch, sm_scale=0.125), batch, "float32")


@needs_native
@pytest.mark.parametrize("level", isa_level_params(LEVELS))
@pytest.mark.parametrize("q_dtype, pages_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_native_mixed_query_and_page_dtypes(level, q_dtype, pages_dtype):
    """The native kernel's other routines: bf16 x bf16 uses the BF16 dot product where the
    CPU has it, these pairings convert to float32."""
    batch = list(make_batch(Shape(dtype=pages_dtype), BATCHES["mixed"], seed=2))
    batch[0] = batch[0].astype(q_dtype)
    out = BACKENDS[f"native-{level}"](*batch, sm_scale=0.125)
    assert out.dtype == jnp.dtype(q_dtype)
    assert_matches_reference(out, reference(*batch, sm_scale=0.125), batch, "bfloat16")


@backends
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_ragged_batches(backend, data):
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
    check(backend, shape, seqs, seed=data.draw(st.integers(0, 99)))


@needs_native
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_native_kv_write_in_place_matches_scatter(pool_dtype):
    rng = np.random.default_rng(0)
    shape = (2, 6, 4, 8)  # [Hkv, P, ps, D]
    k = jnp.asarray(rng.standard_normal(shape), pool_dtype)
    v = jnp.asarray(rng.standard_normal(shape), pool_dtype)
    new_k = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    new_v = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    slots = jnp.asarray([3, 17, 2**31 - 1, 0, 23], jnp.int32)  # one padding row
    expected = write_kv(k, v, new_k, new_v, slots)
    got = jax.jit(native.write_kv_native, donate_argnums=(0, 1))(
        jnp.array(k), jnp.array(v), new_k, new_v, slots
    )
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(e, np.float32), np.asarray(g, np.float32))


def test_engine_falls_back_to_xla_without_a_compiler(monkeypatch):
    """No C++ compiler: `auto` resolves to the XLA path, never an error."""
    from jaxcb import attention

    def no_compiler(*args):
        raise native.NativeBuildError("no C++ compiler found")

    monkeypatch.setattr(native.build, "load", no_compiler)
    assert attention.resolve_backend("auto", platform="cpu") == "xla"
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        attention.get_attention_backend("native", platform="cpu")


@pytest.mark.parametrize("level", isa_level_params(LEVELS, needs_native))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_q_heads", [6, 8])  # groups of 3 and 4 query heads per KV head
def test_native_row_is_computed_as_a_lone_decode_row(level, dtype, num_q_heads):
    """A sequence's query row comes out bit for bit as the same row decoded alone (kv_len up
    to its position) while the sequence has at most 17 query tokens: the rows a speculative
    step verifies give the tokens decoding them one by one gives."""
    shape = Shape(
        num_tokens=32, num_q_heads=num_q_heads, num_pages=40, pages_per_seq=24, dtype=dtype
    )
    attend = BACKENDS[f"native-{level}"]
    for q_len, kv_len in ((5, 300), (17, 280), (2, 17)):
        q, k, v, kv_lens, pages, cu, num_seqs = make_batch(shape, [(q_len, kv_len)], seed=q_len)
        many = attend(q, k, v, kv_lens, pages, cu, num_seqs, sm_scale=0.125)
        for j in range(q_len):
            alone = attend(
                jnp.zeros_like(q).at[0].set(q[j]),
                k,
                v,
                kv_lens.at[0].set(kv_len - q_len + j + 1),
                pages,
                jnp.zeros_like(cu).at[1:].set(1),
                num_seqs,
                sm_scale=0.125,
            )
            np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(many[j]))
