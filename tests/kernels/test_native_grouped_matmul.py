"""jaxcb's native grouped matmuls (jaxcb/native/grouped.py): a mixture of experts' rows,
sorted by expert, each through its own expert's packed matrix. Every kernel of PACKED_MATMULS
this CPU runs (the float32 and bfloat16 ones, at each ISA level it has: the AVX2 kernels run
on AVX-512 CPUs too) against a numpy per-group reference and, bit for bit, against its own
dense kernel on each group's rows; the model-side dispatch (models/packed.py) against the
ragged_dot path; the packing of expert stacks at load."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb import native
from jaxcb.models import cpu_params
from jaxcb.models import packed as packed_models
from jaxcb.models.base import ParamInfo

KERNELS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not native.PACKED_MATMULS[name].available(), reason=f"no {name} on this CPU"
        ),
    )
    for name in native.GROUPED_TARGETS
]

FUSED = [p for p in KERNELS if native.GROUPED_TARGETS[p.values[0]].swiglu is not None]

# (M, K, N, group sizes): zero-sized groups, padding rows past the sum, one group holding
# every row, a single row, no rows at all, and sizes past M (cut at M, as ragged_dot reads them).
CASES = [
    (37, 64, 48, [7, 0, 12, 0, 15]),
    (20, 32, 80, [0, 0, 20, 0]),
    (1, 32, 16, [0, 1, 0]),
    (16, 96, 64, [1, 0, 2, 0, 1, 0, 0, 0]),
    (5, 32, 16, [0, 0, 0]),
    (15, 32, 32, [10, 10]),
    (50, 64, 48, [10, 0, 40]),  # a long group ending at M (AMX reads whole 32-row blocks)
    (150, 512, 1024, [40, 0, 70, 1, 30, 0, 0, 9]),
]


def _inputs(spec, m, k, n, groups, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = np.asarray(rng.standard_normal((groups, k, n)).astype(np.float32)).astype(spec.dtype)
    return x, w


def _ranges(m, sizes):
    """Each group's rows [start, end), cut at m."""
    start = 0
    for size in sizes:
        end = min(m, start + max(size, 0))
        yield start, end
        start = end


def _reference(x, w, sizes):
    """float64 x @ w[g] over each group's rows; zeros past them."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, (start, end) in enumerate(_ranges(x.shape[0], sizes)):
        out[start:end] = x[start:end] @ w[g]
    return out


def _assert_sums_close(got, x, w, sizes):
    """got within the float32 summation bound of the float64 reference: |error| <= 2 K u
    (|x| @ |w|), u = 2^-24 (the products of the rounded inputs are exact in float32)."""
    bound = 2 * x.shape[1] * 2.0**-24 * _reference(np.abs(x), np.abs(w), sizes) + 1e-30
    error = np.abs(np.asarray(got, np.float64) - _reference(x, w, sizes))
    assert (error <= bound).all(), f"max excess {np.max(error - bound)}"


def _rounded(spec, x):
    """x as the kernels read it: rounded to the weights' dtype."""
    return np.asarray(x.astype(spec.dtype).astype(jnp.float32))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m, k, n, sizes", CASES)
def test_grouped_matmul_is_each_groups_matmul(kernel, m, k, n, sizes):
    spec = native.PACKED_MATMULS[kernel]
    x, w = _inputs(spec, m, k, n, len(sizes), m + n)
    stack = jnp.asarray(native.pack_experts(kernel, w))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(functools.partial(native.packed_grouped_matmul, kernel))(x, stack, group_sizes)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    got = np.asarray(got)
    _assert_sums_close(got, _rounded(spec, x), w, sizes)
    used = min(m, sum(sizes))
    assert not got[used:].any()  # padding rows: zero
    # Bit for bit a dense kernel of the same tiles on the group's rows alone: a row's sums
    # never depend on the rows beside it (on AMX, another group's rows in the same tile).
    # AMX runs a group of a few rows on the vdpbf16ps tiles (the same layout).
    dense = [spec] + ([native.PACKED_MATMULS["avx512_bf16"]] if kernel == "amx" else [])
    for g, (start, end) in enumerate(_ranges(m, sizes)):
        if end > start:
            w_g = jnp.asarray(spec.pack(w[g]))
            outs = [np.asarray(jax.jit(d.kernel)(x[start:end], w_g)) for d in dense]
            assert any(np.array_equal(got[start:end], out) for out in outs), (kernel, g)


@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize(
    "m, k, i, sizes",
    [(23, 64, 48, [5, 0, 9, 3]), (1, 32, 16, [0, 1]), (40, 512, 1024, [0, 20, 0, 12, 1])],
)
def test_grouped_swiglu_is_silu_gate_times_up(kernel, m, k, i, sizes):
    """From one [E, K, 2, I] gate_up stack (each expert packed as [K, 2 * I], gate then up);
    I / 16 odd pairs the last gate block alone; written in the kernel's act_dtype. The gate
    and up sums are the grouped matmul's (checked above against float64), so the activation
    is checked against float32 silu of those."""
    spec = native.PACKED_MATMULS[kernel]
    x, w = _inputs(spec, m, k, 2 * i, len(sizes), m + i)
    x = x.at[0, :].set(40.0)  # large |gate| on both sides: silu's tails
    stack = jnp.asarray(native.pack_experts(kernel, w.reshape(len(sizes), k, 2, i)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    fn = jax.jit(functools.partial(native.packed_grouped_swiglu, kernel))
    got = fn(x, stack, group_sizes)
    assert got.shape == (m, i) and got.dtype == spec.act_dtype
    gate_up = native.packed_grouped_matmul(kernel, x, stack, group_sizes)
    _assert_sums_close(gate_up, _rounded(spec, x), w, sizes)
    expected = jax.nn.silu(gate_up[:, :i]) * gate_up[:, i:]
    tol = 1e-2 if spec.act_dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(expected), rtol=tol, atol=tol
    )
    assert not np.asarray(got, np.float32)[sum(sizes) :].any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("i", [48, 8])  # 8: an odd number of 16-column blocks, not fused
def test_models_grouped_matmuls_packed_match_ragged_dot(kernel, i):
    """packed.grouped_matmul / grouped_swiglu on a stack packed at load equal their
    ragged_dot path on the plain weights (padding rows included: zero on both)."""
    spec = native.PACKED_MATMULS[kernel]
    sizes, m, k = [3, 0, 6, 1, 0, 2], 16, 64
    rng = np.random.default_rng(i)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    gate_up = jnp.asarray(rng.standard_normal((len(sizes), k, 2, i)), spec.dtype)
    down = jnp.asarray(rng.standard_normal((len(sizes), i, k)), spec.dtype)
    infos = {
        "w_gate_up": ParamInfo(gate_up.shape, ("expert", "embed", "pair", "mlp"), experts=True),
        "w_down": ParamInfo(down.shape, ("expert", "mlp", "embed"), experts=True),
    }
    plain = {"w_gate_up": gate_up, "w_down": down}
    packed = cpu_params._pack_weights(plain, infos, kernel, greedy_screen=False)

    @jax.jit
    def moe(params, x):
        act = packed_models.grouped_swiglu(x, params["w_gate_up"], group_sizes)
        out = packed_models.grouped_matmul(act, params["w_down"], group_sizes)
        return act.astype(jnp.float32), out

    assert list(packed["w_gate_up"]) == [kernel]
    assert isinstance(packed["w_down"], dict) == spec.can_pack((i, k))  # bf16: K % 32
    for got, want in zip(moe(packed, x), moe(plain, x), strict=True):
        tol = 2e-2 if spec.dtype == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        assert not np.asarray(got)[sum(sizes) :].any()


def test_pack_weights_packs_expert_stacks_of_the_kernels_dtype():
    """ParamInfo.experts leaves of the kernel's dtype become {kernel: [E, ...packed]}; other
    dtypes, shapes off the layout and non-matmul leaves stay as they are."""
    kernel = "avx2"  # (packing is numpy only: no kernel needs to run)
    rng = np.random.default_rng(0)
    params = {
        "experts": rng.standard_normal((4, 32, 2, 16)).astype(np.float32),
        "odd": rng.standard_normal((4, 32, 12)).astype(np.float32),  # 12 columns: no layout
        "bf16": rng.standard_normal((4, 32, 16)).astype(jnp.bfloat16),
        "router": rng.standard_normal((32, 4)).astype(np.float32),
    }
    infos = {
        name: ParamInfo(w.shape, ("expert", "embed", *("mlp",) * (w.ndim - 2)), experts=True)
        for name, w in params.items()
        if name != "router"
    }
    infos["router"] = ParamInfo((32, 4), ("embed", "expert"))
    out = cpu_params._pack_weights(params, infos, kernel, greedy_screen=False)
    assert list(out["experts"]) == [kernel]
    stack = out["experts"][kernel]
    assert stack.shape == (4, 2, 32, 16)  # [E, N/16, K, 16]
    np.testing.assert_array_equal(stack[2], native.pack_f32(params["experts"][2].reshape(32, 32)))
    for name in ("odd", "bf16", "router"):
        assert out[name] is params[name]


@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_matmul_rejects_mismatched_groups(kernel):
    spec = native.PACKED_MATMULS[kernel]
    stack = jnp.asarray(native.pack_experts(kernel, np.zeros((3, 32, 16), spec.dtype)))
    with pytest.raises(ValueError, match="3 experts' weights but 2 group sizes"):
        native.packed_grouped_matmul(kernel, jnp.zeros((4, 32)), stack, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="cannot pack"):
        native.pack_experts(kernel, np.zeros((3, 32, 12), spec.dtype))


def test_every_packed_kernel_has_a_grouped_form():
    """_pack_weights packs expert stacks for whichever kernel the dense weights use."""
    assert set(native.GROUPED_TARGETS) == set(native.PACKED_MATMULS)
