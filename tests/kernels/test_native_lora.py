"""The native LoRA kernel (jaxcb/native/lora.py, lora.cc): each token row through its own
slot's A and B only, added in place to the base matmul's output, against XLA's masked form
(jaxcb/lora.py's `lora_delta`) for the weights' shapes the layers have: q/k/v interleaved per
KV head, gate and up side by side, one part; ranks that are and are not multiples of 16 (an
odd one), an odd input width (pairs of the AVX512-BF16 form padded); base
rows, padding rows, slots past the arrays (left as they are)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb import lora, native
from jaxcb.models.layers import rms_norm

pytestmark = pytest.mark.skipif(
    not native.can_add_lora(jnp.float32), reason="no native LoRA kernel on this CPU"
)

LAYERS, SLOTS = 3, 3

# weight -> (K, each part's output shape, the part axis of the weight's output)
WEIGHTS = {
    "wqkv": (48, [(2, 3, 16), (2, 1, 16), (2, 1, 16)]),  # Hkv 2, G 3, D 16
    "w_gate_up": (32, [(1, 80), (1, 80)]),
    "wo": (40, [(56,)]),
    "w_down": (41, [(24,)]),  # an odd K: the bf16 dot kernel's pairs padded
}


def _stacks(name, rank, dtype, seed):
    k, part_shapes = WEIGHTS[name]
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((LAYERS, k, len(part_shapes), SLOTS, rank)) / math.sqrt(k)
    bs = [rng.standard_normal((LAYERS, SLOTS, rank, *s)) / math.sqrt(rank) for s in part_shapes]
    return jnp.asarray(a, dtype), [jnp.asarray(b, dtype) for b in bs]


def _reference(y, x, slots, real, layer, a, bs, name):
    """lora_delta over every slot, masked to each row's (real rows, slots 1..N only)."""
    real_rows = (jnp.arange(len(slots)) < real)[:, None]
    mask = (slots[:, None] == jnp.arange(1, SLOTS + 1)[None, :]) & real_rows
    weights = {"a": a[layer], "b": [b[layer] for b in bs]}
    return y + lora.lora_delta(x, weights, name, mask.astype(jnp.float32)).reshape(y.shape)


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("rank", [16, 8, 40, 7])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_the_masked_xla_term(name, rank, dtype):
    a, bs = _stacks(name, rank, dtype, seed=rank)
    k, part_shapes = WEIGHTS[name]
    cols = sum(math.prod(s) for s in part_shapes)
    rng = np.random.default_rng(1)
    m, real, layer = 37, 33, 1
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((m, cols)), jnp.float32)
    # base rows, each slot, a slot past the arrays (4: as the base), padding rows with slots
    slots = jnp.asarray(rng.integers(0, SLOTS + 2, m), jnp.int32)
    runs = lora.column_runs(name, part_shapes)

    @jax.jit
    def both(y, x, slots, layer):
        out = native.lora_add(y, x, slots, real, layer, a, bs, runs)
        return out, y  # y read after the in-place add: XLA must keep its own copy

    out, y_after = both(y, x, slots, jnp.int32(layer))
    ref = _reference(y, x, slots, real, layer, a, bs, name)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(y_after), np.asarray(y))
    untouched = (np.asarray(slots) == 0) | (np.asarray(slots) > SLOTS) | (np.arange(m) >= real)
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_norms_the_adapter_rows_of_a_normed_input(dtype, norm_dtype):
    """Given the layer's input norm (a Normed input: the base kernel norms in its call), the
    kernel's term is that of the RMS-normed rows."""
    a, bs = _stacks("w_gate_up", 16, dtype, seed=3)
    k, part_shapes = WEIGHTS["w_gate_up"]
    rng = np.random.default_rng(2)
    m, real, layer, eps = 21, 19, 2, 1e-5
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.float32)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, k), norm_dtype)
    y = jnp.asarray(rng.standard_normal((m, 160)), jnp.float32)
    slots = jnp.asarray(rng.integers(0, SLOTS + 1, m), jnp.int32)
    runs = lora.column_runs("w_gate_up", part_shapes)
    out = native.lora_add(y, x, slots, real, layer, a, bs, runs, norm=(weight, eps))
    ref = _reference(y, rms_norm(x, weight, eps), slots, real, layer, a, bs, "w_gate_up")
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol, atol=tol)
    unnormed = _reference(y, x, slots, real, layer, a, bs, "w_gate_up")
    assert not np.allclose(np.asarray(out), np.asarray(unnormed), rtol=tol, atol=tol)


def test_a_step_without_adapter_rows_returns_y():
    a, bs = _stacks("wo", 16, jnp.bfloat16, seed=0)
    y = jnp.asarray(np.random.default_rng(0).standard_normal((8, 56)), jnp.float32)
    x = jnp.ones((8, 40), jnp.float32)
    run = functools.partial(native.lora_add, runs=lora.column_runs("wo", [(56,)]))
    out = jax.jit(run)(y, x, jnp.zeros(8, jnp.int32), 8, 0, a, bs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(y))


def test_column_runs_place_q_k_v_per_kv_head():
    # [Hkv 2, G + 2 = 5, D 4]: q's 3 heads, then k, then v, per KV head
    assert lora.column_runs("wqkv", [(2, 3, 4), (2, 1, 4), (2, 1, 4)]) == [
        (12, 20, 0),
        (4, 20, 12),
        (4, 20, 16),
    ]
    assert lora.column_runs("w_gate_up", [(1, 6), (1, 6)]) == [(6, 12, 0), (6, 12, 6)]
    assert lora.column_runs("w_down", [(9,)]) == [(9, 9, 0)]
