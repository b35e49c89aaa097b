"""HBM traffic read off optimized HLO: VMEM copies, in-place writes, slices, branches."""

from __future__ import annotations

import importlib.util

import pytest

from jaxcb.runtime.hbm_traffic import hbm_bytes, parse_module, shape_bytes

# A hand-written module in the form of XLA's optimized TPU text: a weight prefetched into
# VMEM (S(1)) and used by a dot fusion, an embedding gather fusion, an in-place KV scatter
# fusion, a conditional with a heavy and a light branch, and a while loop.
MODULE = """HloModule step, entry_computation_layout={()}

%gather_body (p0: bf16[1000,64], p1: s32[8]) -> bf16[8,64] {
  %p0 = bf16[1000,64]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[8]{0} parameter(1)
  ROOT %g = bf16[8,64]{1,0} gather(%p0, %p1), offset_dims={1}, slice_sizes={1,64}
}

%dot_body (a: bf16[8,64], w: bf16[64,256]) -> f32[8,256] {
  %a = bf16[8,64]{1,0} parameter(0)
  %w = bf16[64,256]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %d = f32[8,256]{1,0} convolution(%a, %w), dim_labels=bf_io->bf
}

%scatter_body (pool: bf16[4,100,64], idx: s32[8], upd: bf16[8,64]) -> bf16[4,100,64] {
  %pool = bf16[4,100,64]{2,1,0} parameter(0)
  %idx = s32[8]{0} parameter(1)
  %upd = bf16[8,64]{1,0} parameter(2)
  ROOT %s = bf16[4,100,64]{2,1,0} scatter(%pool, %idx, %upd), to_apply=%add
}

%heavy (h: f32[8,256]) -> f32[8,256] {
  %h = f32[8,256]{1,0} parameter(0)
  %e = f32[8,256]{1,0} exponential(%h)
  ROOT %n = f32[8,256]{1,0} negate(%e)
}

%light (l: f32[8,256]) -> f32[8,256] {
  ROOT %l = f32[8,256]{1,0} parameter(0)
}

%cond (c: s32[]) -> pred[] {
  %c = s32[] parameter(0)
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%c, %k), direction=LT
}

%body (b: s32[]) -> s32[] {
  %b = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %next = s32[] add(%b, %one)
}

ENTRY %main (table: bf16[1000,64], ids: s32[8], w: bf16[64,256]) -> f32[8,256] {
  %table = bf16[1000,64]{1,0:T(8,128)(2,1)} parameter(0)
  %ids = s32[8]{0} parameter(1)
  %w = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(2)
  %pool = bf16[4,100,64]{2,1,0} parameter(3)
  %flag = s32[] parameter(4)
  %cs = (bf16[64,256]{1,0:T(8,128)(2,1)S(1)}, bf16[64,256]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) \
copy-start(%w), cross_program_prefetch_index=0
  %x = bf16[8,64]{1,0} fusion(%table, %ids), kind=kLoop, calls=%gather_body
  %cd = bf16[64,256]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %y = f32[8,256]{1,0} fusion(%x, %cd), kind=kOutput, calls=%dot_body
  %kv = bf16[4,100,64]{2,1,0} fusion(%pool, %ids, %x), kind=kLoop, calls=%scatter_body
  %z = f32[8,256]{1,0} conditional(%flag, %y, %y), branch_computations={%heavy, %light}
  %loop = s32[] while(%flag), condition=%cond, body=%body
  ROOT %out = (f32[8,256]{1,0}, bf16[4,100,64]{2,1,0}) tuple(%z, %kv)
}
"""


def test_shape_bytes_skips_on_chip_memory():
    assert shape_bytes("bf16[64,256]{1,0:T(8,128)(2,1)}") == 64 * 256 * 2
    assert shape_bytes("bf16[64,256]{1,0:T(8,128)(2,1)S(1)}") == 0
    assert shape_bytes("bf16[64,256]{1,0:T(8,128)(2,1)S(1)}", hbm_only=False) == 64 * 256 * 2
    assert shape_bytes("(f32[2,3]{1,0}, s32[4]{0}, u32[]{:S(2)})") == 24 + 16


def test_parse_module_links_users_and_finds_the_entry():
    computations, entry = parse_module(MODULE)
    assert entry == "main" and "gather_body" in computations
    main = {i.name: i for i in computations[entry]}
    assert main["cs"].op == "copy-start" and main["cs"].operands == ["w"]
    assert [u.name for u in main["ids"].users] == ["x", "kv"]
    assert main["z"].op == "conditional" and "%heavy" in main["z"].attrs


def test_each_instruction_counted_as_a_tpu_program_moves_it():
    weight, row, out = 64 * 256 * 2, 64 * 2, 8 * 256 * 4
    prefetch = weight  # read once from HBM into VMEM; the dot reads the VMEM copy
    gather = 8 * row + 8 * 4 + 8 * row  # the 8 rows (not the table), the ids, the result
    dot = 8 * row + out  # its input and its output; the weight is in VMEM
    scatter = 8 * 4 + 8 * row + 2 * 8 * row  # ids, update read; the rows written in place
    heavy = 2 * out + 2 * out  # exponential and negate: each reads and writes [8, 256]
    # the body's add and the condition's compare, per trip: 3 (its condition `c < 3`, read
    # as a scan's: counting from 0)
    loop = 3 * ((4 + 4 + 4) + (4 + 4 + 1))
    light = prefetch + gather + dot + scatter + loop
    assert hbm_bytes(MODULE, branch="min") == light
    assert hbm_bytes(MODULE) == light + heavy


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs jax[tpu]")
def test_a_compiled_tpu_matmul_moves_its_operands_once():
    """A [256, 4096] x [4096, 12288] bf16 matmul compiled for v5e: XLA's cost_analysis
    counts ~5x the bytes (its VMEM copy of the weight, and the dot reading it); the HBM
    traffic is the weight, the input and the output, once."""
    import jax
    import jax.numpy as jnp

    from jaxcb.runtime import aot

    device = aot.target_devices("v5e:1x1")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((4096, 12288), jnp.bfloat16, sharding=sharding)
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    ideal = (4096 * 12288 + 256 * 4096 + 256 * 12288) * 2
    assert compiled.cost_analysis()["bytes accessed"] > 3 * ideal
    assert ideal <= hbm_bytes(compiled.as_text()) <= 1.05 * ideal


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs jax[tpu]")
def test_a_compiled_tpu_scan_reads_one_layer_of_the_stack_per_trip():
    """A scan over 4 layers of a stacked [4, 3072, 4096] bf16 weight compiled for v5e: XLA
    fuses each trip's dynamic slice into the dot (in a nested fusion), so a trip reads its
    layer, not the stack: the program moves the stack about once, not 4 times."""
    import jax
    import jax.numpy as jnp

    from jaxcb.runtime import aot

    device = aot.target_devices("v5e:1x1")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((64, 3072), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((4, 3072, 4096), jnp.bfloat16, sharding=sharding)

    def layers(x, w):
        def one(x, layer):
            y = jnp.dot(x, w[layer], preferred_element_type=jnp.float32)
            return y[:, :3072].astype(x.dtype), None

        return jax.lax.scan(one, x, jnp.arange(4))[0]

    text = jax.jit(layers).lower(x, w).compile().as_text()
    stack = 4 * 3072 * 4096 * 2
    assert stack <= hbm_bytes(text) <= 1.1 * stack
