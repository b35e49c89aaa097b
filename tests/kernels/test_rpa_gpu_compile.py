"""The Triton kernel compiled for an H100 by XLA's real GPU compiler, on a machine with no GPU.

`pallas_kernels.gpu_targets.gpu_topology()` gives compile-only H100 devices (XLA's H100 SXM
description); `jax.jit(...).lower(abstract args on that device).compile()` then runs the
whole path: Pallas -> Triton IR -> Triton's passes (layouts, shared memory) -> PTX -> sm_90a
cubin. What interpret mode and IR lowering cannot show surfaces here: shared-memory overflow
(a RESOURCE_EXHAUSTED compile error) and the real shared memory of each kernel, which XLA
writes into the dumped thunk sequence; the tests hold it equal to the tuning estimate.
Deviceless compiles skip autotuning; nothing runs. Needs jax's CUDA plugin (the `cuda`
extra), skipped without it; about 2 s per compile on 2 cores.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from rpa_cases import Shape, abstract_args, abstract_scales

from pallas_kernels.gpu_targets import cuda_plugin_installed, gpu_topology
from pallas_kernels.ragged_paged_attention import (
    gpu_block_sizes,
    gpu_shared_memory_bytes,
    ragged_paged_attention_gpu,
)
from pallas_kernels.ragged_paged_attention.tuning import H100_SHARED_MEMORY_PER_BLOCK

pytestmark = pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason="compiling for H100 needs jax's CUDA plugin (pip install 'jax[cuda12]'); no GPU",
)

#: (num_q_heads, num_kv_heads) of a model per head_dim: SmolLM2 (G=3), Phi-2, Phi-3,
#: Llama-3-8B, Gemma-2-9B.
HEADS = {64: (12, 4), 80: (32, 32), 96: (32, 32), 128: (32, 8), 256: (16, 8)}


def bucket(head_dim: int, kind: str, dtype: str = "bfloat16") -> Shape:
    """A decode bucket (16 sequences of up to 8192 tokens: the rule splits KV) or a prefill
    bucket (2048 tokens of 256 sequences), with a pool of 4096 pages of 16 tokens."""
    num_q_heads, num_kv_heads = HEADS[head_dim]
    tokens, seqs = (16, 16) if kind == "decode" else (2048, 256)
    return Shape(
        num_tokens=tokens,
        max_num_seqs=seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=4096,
        pages_per_seq=512,
        dtype=dtype,
    )


@pytest.fixture(scope="module")
def h100():
    return gpu_topology().devices[0]


def compile_for(device, shape: Shape, dump_dir: pathlib.Path, kv_dtype=None, **kwargs):
    """Compile the kernel for `device` (pages of `kv_dtype`, "int8" / "fp8_*", with their
    scales, if given); returns (compiled, kernel's shared memory, grid)."""
    fn = jax.jit(
        functools.partial(ragged_paged_attention_gpu, sm_scale=shape.head_dim**-0.5, **kwargs)
    )
    sharding = jax.sharding.SingleDeviceSharding(device)
    scales = abstract_scales(shape, sharding) if kv_dtype else {}
    lowered = fn.lower(*abstract_args(shape, sharding, kv_dtype=kv_dtype), **scales)
    compiled = lowered.compile(compiler_options={"xla_dump_to": str(dump_dir)})
    (thunks,) = dump_dir.glob("*.thunk_sequence.txt")
    match = re.search(
        r"ragged_paged_attention_gpu grid: \[(\d+), (\d+), (\d+)\].*?shared_memory: (\d+) bytes",
        thunks.read_text(),
    )
    assert match, "the kernel's launch is missing from the thunk sequence"
    *grid, smem = (int(x) for x in match.groups())
    return compiled, smem, tuple(grid)


def chosen_blocks(shape: Shape, kv_scales: bool = False):
    return gpu_block_sizes(
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        num_tokens=shape.num_tokens,
        max_num_seqs=shape.max_num_seqs,
        pages_per_seq=shape.pages_per_seq,
        itemsize=jnp.dtype(shape.dtype).itemsize,
        kv_scales=kv_scales,
    )


def estimate(shape: Shape, blocks, kv_scales: bool = False) -> int:
    padded_group = 1 << (shape.num_q_heads // shape.num_kv_heads - 1).bit_length()
    return gpu_shared_memory_bytes(
        head_dim=shape.head_dim,
        query_rows=max(16, blocks.num_queries_per_block * padded_group),
        kv_tokens=blocks.num_kv_pages_per_block * shape.page_size,
        itemsize=jnp.dtype(shape.dtype).itemsize,
        num_stages=blocks.num_stages,
        kv_scales=kv_scales,
    )


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("head_dim", sorted(HEADS))
def test_compiles_for_h100_with_the_estimated_shared_memory(h100, tmp_path, head_dim, kind):
    shape = bucket(head_dim, kind)
    blocks = chosen_blocks(shape)
    compiled, smem, grid = compile_for(h100, shape, tmp_path)
    assert smem == estimate(shape, blocks) <= H100_SHARED_MEMORY_PER_BLOCK
    num_q_blocks = -(-shape.num_tokens // blocks.num_queries_per_block)
    assert grid[:2] == (num_q_blocks, shape.num_kv_heads)
    assert grid[2] == blocks.num_kv_splits
    if kind == "decode":  # 16 sequences, up to 8192 tokens: too few programs, split KV
        assert blocks.num_kv_splits > 1
    assert compiled.memory_analysis().output_size_in_bytes == (
        shape.num_tokens * shape.num_q_heads * head_dim * 2
    )


def test_compiles_f32_with_window_and_soft_cap(h100, tmp_path):
    """float32 dots at full precision (no tensor cores): the estimate is an upper bound by
    at most the reduction scratch's row vector."""
    shape = bucket(128, "prefill", dtype="float32")
    _, smem, _ = compile_for(h100, shape, tmp_path, sliding_window=1024, soft_cap=30.0)
    blocks = chosen_blocks(shape)
    padded_group = 1 << (shape.num_q_heads // shape.num_kv_heads - 1).bit_length()
    rows = max(16, blocks.num_queries_per_block * padded_group)
    assert estimate(shape, blocks) - rows * 4 <= smem <= estimate(shape, blocks)


def test_shared_memory_overflow_is_a_compile_error(h100, tmp_path):
    """A tile the table would never pick: 128 rows x 256 KV tokens at head_dim 256."""
    shape = bucket(256, "prefill")
    blocks = dict(num_queries_per_block=64, num_kv_pages_per_block=16, num_warps=8)
    expected = gpu_shared_memory_bytes(
        head_dim=256, query_rows=128, kv_tokens=256, itemsize=2, num_stages=1
    )
    assert expected > H100_SHARED_MEMORY_PER_BLOCK
    with pytest.raises(
        Exception, match=rf"Shared memory size limit exceeded: requested {expected}"
    ):
        compile_for(h100, shape, tmp_path, **blocks)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize(
    ("head_dim", "kv_dtype"),
    [(128, "int8"), (128, "fp8_e4m3"), (128, "fp8_e5m2"), (64, "int8")],
)
def test_quantized_pages_compile_for_h100(h100, tmp_path, head_dim, kv_dtype, kind):
    """int8 / fp8 pages with bf16 queries: the tiles are loaded as stored and converted to
    bf16 for the dots. Shared memory stays within the estimate (bf16 tiles plus the two f32
    scale vectors; measured equal for prefill tiles, ~10 KB below for decode ones), and the
    declared bytes of a decode bucket fall to ~55% of the bf16 kernel's (K/V at 1 byte, plus
    4 / head_dim for the scales)."""
    shape = bucket(head_dim, kind)
    blocks = chosen_blocks(shape, kv_scales=True)
    assert blocks == chosen_blocks(shape)  # the scales change no tile choice here
    compiled, smem, grid = compile_for(h100, shape, tmp_path / "q", kv_dtype=kv_dtype)
    assert smem <= estimate(shape, blocks, kv_scales=True) <= H100_SHARED_MEMORY_PER_BLOCK
    assert grid[2] == blocks.num_kv_splits
    assert compiled.memory_analysis().output_size_in_bytes == (
        shape.num_tokens * shape.num_q_heads * head_dim * 2
    )
    ratio = declared_bytes(shape, kv_dtype) / declared_bytes(shape)
    assert 0.5 < ratio < (0.6 if kind == "decode" else 0.75)  # prefill: q and output weigh more


def declared_bytes(shape: Shape, kv_dtype=None) -> int:
    """`bytes_accessed` of the kernel's CostEstimate (deviceless GPU compiles report no cost
    analysis), read from the traced pallas_call."""
    fn = functools.partial(ragged_paged_attention_gpu, sm_scale=1.0)
    scales = abstract_scales(shape) if kv_dtype else {}
    jaxpr = jax.make_jaxpr(lambda *a, **k: fn(*a, **k))(
        *abstract_args(shape, kv_dtype=kv_dtype), **scales
    )
    found = []

    def visit(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn.params["cost_estimate"].bytes_accessed)
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    visit(inner)

    visit(jaxpr.jaxpr)
    (bytes_accessed,) = found
    return bytes_accessed
