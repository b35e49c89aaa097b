"""The TPU kernel and the KV write compiled by libtpu for a TPU v5e chip, with no TPU present.

`jax.experimental.topologies.get_topology_desc("v5e:1x1", platform="tpu")` gives a
compile-only v5e device; `jax.jit(...).lower(abstract args on its mesh).compile()` then runs
Mosaic's passes and XLA's TPU compiler, so what interpret mode and IR lowering cannot show
surfaces here: SMEM/VMEM overflows, unaligned DMAs, layout copies XLA inserts around the
kernel, and the compiled program's memory and cost. Needs libtpu (the `tpu` extra), skipped
without it; a few seconds per compile on 2 cores.

The shapes are a v5e decode step of one layer of an 8B model at tensor parallel 4 (2 KV
heads and 8 query heads per chip, head_dim 128, page 16, bf16) with a 16k-token context
limit and 512 sequences, so the page table (512 x 1024 ids, 2 MiB) is twice v5e's 1 MiB
SMEM: the whole-table scalar prefetch the kernel used to do cannot compile there.

Quantized pools (int8, fp8 e4m3 / e5m2 pages with f32 scales) compile for v5e too (Mosaic
converts fp8 there as well), with no copy of the pool or of its scales: XLA stores a
`[H, num_pages, 16]` f32 array with the pages on lanes, and the kernel's
`[H, 16, num_pages]` view of it is a bitcast.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.ragged_paged_attention import (
    QUANTIZED_KV_DTYPES,
    ragged_paged_attention_tpu,
    write_kv,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for TPU needs libtpu (pip install 'jax[tpu]'); no TPU is needed",
)

#: What libtpu reads when it loads: no GCE metadata probe, a worker host name (else it logs
#: an error), and no lock file (other processes may be compiling for TPU at the same time).
LIBTPU_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

NUM_TOKENS = NUM_SEQS = 512
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 2, 128, 16
PAGES_PER_SEQ = 1024  # 16k tokens
NUM_PAGES = 21_372  # one chip's pool of the 8B preset on v5e x4: 175 MB per K or V array
POOL_SHAPE = (NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM)
POOL_BYTES = NUM_KV_HEADS * NUM_PAGES * PAGE_SIZE * HEAD_DIM * 2  # one bf16 array
V5E_SMEM_BYTES = 1 << 20


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    from jax.experimental import topologies

    for key, value in LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    topology = topologies.get_topology_desc(
        topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)
    )
    return topologies.make_mesh(topology, (1,), ("x",))


def abstract(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def attention_args(mesh, num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS, kv_dtype=jnp.bfloat16):
    """Abstract (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)."""
    return (
        abstract(mesh, (num_tokens, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16),
        abstract(mesh, POOL_SHAPE, kv_dtype),
        abstract(mesh, POOL_SHAPE, kv_dtype),
        abstract(mesh, (num_seqs,), jnp.int32),
        abstract(mesh, (num_seqs, PAGES_PER_SEQ), jnp.int32),
        abstract(mesh, (num_seqs + 1,), jnp.int32),
        abstract(mesh, (1,), jnp.int32),
    )


def per_chip(mesh, kernel):
    """A Mosaic kernel runs inside shard_map (it carries no sharding rules)."""
    spec = PartitionSpec()
    return jax.shard_map(kernel, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)


def compile_on(mesh, fn, *args, donate=()):
    with jax.set_mesh(mesh):
        return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def test_the_page_table_does_not_fit_smem(mesh):
    """The premise: a kernel that scalar-prefetches this page table whole (as the TPU kernel
    did) fails to compile for v5e with an SMEM overflow."""
    table = abstract(mesh, (NUM_SEQS * PAGES_PER_SEQ,), jnp.int32)
    assert table.size * 4 > V5E_SMEM_BYTES

    def first_id(table):
        def kernel(table_ref, out_ref):
            out_ref[0] = table_ref[table_ref.shape[0] - 1]

        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(1,),
                in_specs=[],
                out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
            ),
            out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
        )(table)

    with pytest.raises(Exception, match=r"(?s)RESOURCE_EXHAUSTED.*smem"):
        compile_on(mesh, per_chip(mesh, first_id), table)


@pytest.mark.parametrize(
    "options",
    [{}, dict(sliding_window=1024, soft_cap=30.0, num_kv_pages_per_block=3)],
    ids=["default", "window_cap_3_pages"],
)
def test_kernel_compiles_with_a_table_larger_than_smem(mesh, options):
    """The table stays in HBM (per-KV-block chunks go to SMEM): it compiles, adds no
    temporaries (no relayout or copy of the table or the pool), and declares its cost."""
    kernel = functools.partial(ragged_paged_attention_tpu, sm_scale=HEAD_DIM**-0.5, **options)
    compiled = compile_on(mesh, per_chip(mesh, kernel), *attention_args(mesh))
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    cost = compiled.cost_analysis()
    # The CostEstimate's full-pool assumption: all of K and V read once at decode.
    assert 0.9 * 2 * POOL_BYTES < cost["bytes accessed"] < 1.1 * 2 * POOL_BYTES
    assert cost["flops"] > 4 * NUM_TOKENS * NUM_Q_HEADS * HEAD_DIM * PAGE_SIZE
    assert cost["transcendentals"] > 0


@pytest.mark.parametrize(
    "head_dim, options", [(96, {}), (256, dict(sliding_window=1024, soft_cap=30.0))], ids=str
)
def test_kernel_compiles_for_phi3_and_gemma_head_dims(mesh, head_dim, options):
    """head_dim 96 (Phi-3: less than one 128-lane tile) and 256 (Gemma, with its window and
    soft cap) compile for v5e too, with no temporaries (small pool and table)."""
    q = abstract(mesh, (64, NUM_Q_HEADS, head_dim), jnp.bfloat16)
    pool = abstract(mesh, (NUM_KV_HEADS, 512, PAGE_SIZE, head_dim), jnp.bfloat16)
    lens = [abstract(mesh, (n,), jnp.int32) for n in (16, 17, 1)]
    table = abstract(mesh, (16, 64), jnp.int32)
    kernel = functools.partial(ragged_paged_attention_tpu, sm_scale=head_dim**-0.5, **options)
    compiled = compile_on(mesh, per_chip(mesh, kernel), q, pool, pool, lens[0], table, *lens[1:])
    assert compiled.memory_analysis().temp_size_in_bytes == 0


def test_layer_write_and_attention_never_copy_the_pool(mesh):
    """One layer's write_kv + attention, pool donated: the write is in place (the pool is
    aliased, no pool-shaped copy or temporary: ACCELERATORS.md finding 1) and the counted
    bytes are about one read of the pool, not the five of the reshaped write."""
    args = attention_args(mesh)
    new = abstract(mesh, (NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
    slots = abstract(mesh, (NUM_TOKENS,), jnp.int32)
    attend = per_chip(mesh, functools.partial(ragged_paged_attention_tpu, sm_scale=HEAD_DIM**-0.5))

    def layer(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k, v, slots):
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slots)
        out = attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        return out, k_pages, v_pages

    compiled = compile_on(mesh, layer, *args, new, new, slots, donate=(1, 2))
    assert_pool_in_place(compiled)
    assert compiled.cost_analysis()["bytes accessed"] < 1.1 * 2 * POOL_BYTES


def assert_pool_in_place(compiled) -> None:
    """The donated bf16 K and V pools are aliased, never copied, and no temporary is
    pool-sized."""
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes == 2 * POOL_BYTES
    assert memory.temp_size_in_bytes < POOL_BYTES // 100
    pool = re.escape("bf16[" + ",".join(map(str, POOL_SHAPE)) + "]")
    copies = re.findall(rf"= {pool}\S* copy(?:-start)?\(", compiled.as_text())
    assert not copies, f"the compiled program copies the KV pool: {copies}"


def test_scanned_layers_write_and_attend_the_stacked_pool_in_place(mesh):
    """A lax.scan over 4 layers sharing one pool stacked along the pages (the scanned step's
    layout, models/base.py's layer_metadata): each layer's write and attention work on the
    carried pool in place. With every head's row in one scatter update XLA kept the carried
    pool in another tile layout and copied it whole around every layer's write."""
    num_layers = 4
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = attention_args(mesh)
    new = abstract(mesh, (NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
    slots = abstract(mesh, (NUM_TOKENS,), jnp.int32)
    per_layer = NUM_PAGES // num_layers
    attend = per_chip(
        mesh,
        functools.partial(
            ragged_paged_attention_tpu, sm_scale=HEAD_DIM**-0.5, pool_layers=num_layers
        ),
    )

    def layers(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k, v, slots):
        def one(carry, layer):
            x, k_pages, v_pages = carry
            moved = slots + layer * per_layer * PAGE_SIZE
            k_pages, v_pages = write_kv(k_pages, v_pages, k + x[:, :2], v, moved)
            table = page_indices + layer * per_layer
            out = attend(x, k_pages, v_pages, kv_lens, table, cu_q_lens, num_seqs)
            return (out, k_pages, v_pages), None

        layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
        (out, k_pages, v_pages), _ = jax.lax.scan(one, (q, k_pages, v_pages), layer_ids)
        return out, k_pages, v_pages

    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, new, new, slots)
    assert_pool_in_place(compile_on(mesh, layers, *args, donate=(1, 2)))


# --- quantized pools ----------------------------------------------------------------------

#: The pool rounded up to whole 128-page lane chunks of the scales (see kv_write.py).
QUANT_NUM_PAGES = 21_376
SCALES_BYTES = NUM_KV_HEADS * QUANT_NUM_PAGES * PAGE_SIZE * 4  # one f32 scale array


def quantized_args(mesh, kv_dtype, num_pages=QUANT_NUM_PAGES):
    """Abstract (q, k_pages, v_pages, metadata..., k_scales, v_scales) of a quantized pool."""
    q, _, _, *metadata = attention_args(mesh)
    pages = abstract(mesh, (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), kv_dtype)
    scales = abstract(mesh, (NUM_KV_HEADS, num_pages, PAGE_SIZE), jnp.float32)
    return (q, pages, pages, *metadata, scales, scales)


def quantized_attention(mesh, **options):
    """The kernel on a quantized pool: (q, k, v, metadata..., k_scales, v_scales)."""

    def kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, ks, vs):
        return ragged_paged_attention_tpu(
            q,
            k_pages,
            v_pages,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            sm_scale=HEAD_DIM**-0.5,
            k_scales=ks,
            v_scales=vs,
            **options,
        )

    return per_chip(mesh, kernel)


def scale_copies(compiled, num_pages=QUANT_NUM_PAGES) -> list[str]:
    shape = re.escape(f"f32[{NUM_KV_HEADS},{num_pages},{PAGE_SIZE}]")
    return re.findall(rf"= {shape}\S* copy(?:-start)?\(", compiled.as_text())


@pytest.fixture(scope="module")
def bf16_decode_bytes(mesh) -> float:
    kernel = per_chip(mesh, functools.partial(ragged_paged_attention_tpu, sm_scale=HEAD_DIM**-0.5))
    return compile_on(mesh, kernel, *attention_args(mesh)).cost_analysis()["bytes accessed"]


@pytest.mark.parametrize("kv_dtype", sorted(QUANTIZED_KV_DTYPES))
def test_quantized_kernel_compiles_and_reads_half_the_bytes(mesh, kv_dtype, bf16_decode_bytes):
    """1-byte pages: the decode step's counted bytes fall to ~55% of bf16's (K/V halved, plus
    the scales, read whole once: 4 / head_dim of the pool), with no temporaries and no copy
    of the scales (their kernel view is a bitcast)."""
    args = quantized_args(mesh, QUANTIZED_KV_DTYPES[kv_dtype])
    compiled = compile_on(mesh, quantized_attention(mesh), *args)
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert not scale_copies(compiled)
    quantized_bytes = compiled.cost_analysis()["bytes accessed"]
    pool_bytes = 2 * NUM_KV_HEADS * QUANT_NUM_PAGES * PAGE_SIZE * HEAD_DIM  # K, V: 1 byte
    expected = pool_bytes + 2 * SCALES_BYTES
    assert expected < quantized_bytes < 1.1 * expected
    assert 0.5 < quantized_bytes / bf16_decode_bytes < 0.6


def test_quantized_kernel_compiles_with_window_cap_3_pages_and_any_page_count(mesh):
    """Options, and a page count that is no multiple of 128 (the last lane chunk of the
    scales is narrower: read with its own slice)."""
    options = dict(sliding_window=1024, soft_cap=30.0, num_kv_pages_per_block=3)
    args = quantized_args(mesh, jnp.int8, num_pages=NUM_PAGES)
    compiled = compile_on(mesh, quantized_attention(mesh, **options), *args)
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert not scale_copies(compiled, NUM_PAGES)


def quantized_layer(mesh, num_pages=QUANT_NUM_PAGES):
    """One layer's write_kv (quantize, scatter values and scales) and attention on an int8
    pool, its four arrays donated."""
    args = quantized_args(mesh, jnp.int8, num_pages)
    new = abstract(mesh, (NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
    slots = abstract(mesh, (NUM_TOKENS,), jnp.int32)
    attend = quantized_attention(mesh)

    def layer(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, ks, vs, k, v, slots):
        k_pages, v_pages, ks, vs = write_kv(k_pages, v_pages, k, v, slots, k_scales=ks, v_scales=vs)
        out = attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, ks, vs)
        return out, k_pages, v_pages, ks, vs

    return compile_on(mesh, layer, *args, new, new, slots, donate=(1, 2, 7, 8))


def test_quantized_layer_never_copies_the_pool_or_its_scales(mesh):
    """All four arrays updated in place: the values by (head, page, offset), the scales through
    the 1-D view of their tiles (kv_write.scatter_scales_tpu); no pool- or scale-shaped copy,
    and the layer's counted bytes stay well under the bf16 layer's (~1.2 x bf16 pool)."""
    compiled = quantized_layer(mesh)
    memory = compiled.memory_analysis()
    pool_bytes = 2 * NUM_KV_HEADS * QUANT_NUM_PAGES * PAGE_SIZE * HEAD_DIM
    assert memory.alias_size_in_bytes == pool_bytes + 2 * SCALES_BYTES
    assert memory.temp_size_in_bytes < POOL_BYTES // 100
    pool = re.escape("s8[" + ",".join(map(str, (NUM_KV_HEADS, QUANT_NUM_PAGES))))
    assert not re.findall(rf"= {pool}\S* copy(?:-start)?\(", compiled.as_text())
    assert not scale_copies(compiled)
    assert compiled.cost_analysis()["bytes accessed"] < 0.85 * 2 * POOL_BYTES


def test_quantized_layer_with_other_page_counts_moves_more_scale_bytes(mesh):
    """The documented cost of a page count that is no multiple of 128: the scales take the
    values' scatter by (head, page, offset), in place (no copy, no temporaries; with every
    head in one update XLA relayouted both scale arrays through VMEM), but XLA counts ~6x
    the 1-D form's bytes for the layer (1.6 GB against 0.26)."""
    compiled = quantized_layer(mesh, num_pages=NUM_PAGES)
    assert compiled.memory_analysis().temp_size_in_bytes < POOL_BYTES // 100
    assert not scale_copies(compiled, NUM_PAGES)
    assert compiled.cost_analysis()["bytes accessed"] > 2 * POOL_BYTES
