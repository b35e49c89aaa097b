"""The native matmuls read one layer of a weight stacked over layers, in place: every
kernel given a [L, ...] stack and a layer index (an int, or traced in a scan) computes what
it computes for that layer's weight alone, bit for bit; an index off the stack is an error,
never a read past it (models/stacking.py runs the layers this way)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_int8_matmul import quantized

from jaxcb import native

LAYERS = 3

FLOAT_KERNELS = [
    pytest.param(name, marks=pytest.mark.skipif(not spec.available(), reason=f"no {name} here"))
    for name, spec in native.PACKED_MATMULS.items()
]
needs_int8 = pytest.mark.skipif(not native.INT8_MATMUL.available(), reason="no int8 kernel here")


def _stack(spec, k: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((LAYERS, k, n)).astype(np.float32).astype(spec.dtype)
    return np.stack([spec.pack(w) for w in weights])


def _each_layer_agrees(one_layer, stacked) -> None:
    """stacked(layer) equals one_layer(layer), for each layer, by int and scanned."""
    for layer in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(stacked(layer)), np.asarray(one_layer(layer)))

    def body(carry, layer):
        return carry, stacked(layer)

    _, scanned = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(LAYERS)))()
    want = np.stack([np.asarray(one_layer(layer)) for layer in range(LAYERS)])
    np.testing.assert_array_equal(np.asarray(scanned), want)


@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
def test_packed_matmul_and_swiglu_read_their_layer(kernel):
    spec = native.PACKED_MATMULS[kernel]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 64)), jnp.float32)
    stack = jnp.asarray(_stack(spec, 64, 96))
    _each_layer_agrees(
        lambda layer: native.packed_matmul(kernel, x, stack[layer], 3),
        lambda layer: native.packed_matmul(kernel, x, stack, 3, layer),
    )
    if spec.swiglu is not None:
        _each_layer_agrees(
            lambda layer: native.packed_swiglu(kernel, x, stack[layer]),
            lambda layer: native.packed_swiglu(kernel, x, stack, layer=layer),
        )
    if kernel in native.NORM_TARGETS:
        norm = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
        _each_layer_agrees(
            lambda layer: native.packed_norm_matmul(kernel, x, norm, 1e-5, stack[layer], 3),
            lambda layer: native.packed_norm_matmul(kernel, x, norm, 1e-5, stack, 3, layer=layer),
        )


@needs_int8
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_matmuls_and_their_norm_read_their_layer(bits):
    spec = native.INT4_MATMUL if bits == 4 else native.INT8_MATMUL
    stack = jnp.asarray(
        np.stack([spec.pack(quantized(64, 64, seed=s, bits=bits)) for s in range(LAYERS)])
    )
    x = jnp.asarray(np.random.default_rng(2).standard_normal((6, 64)), jnp.float32)
    norm = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
    _each_layer_agrees(
        lambda layer: spec.kernel(x, stack[layer]),
        lambda layer: spec.kernel(x, stack, None, layer),
    )
    _each_layer_agrees(
        lambda layer: native.packed_norm_matmul(
            spec.name, x, norm, 1e-5, stack[layer], swiglu=True
        ),
        lambda layer: native.packed_norm_matmul(
            spec.name, x, norm, 1e-5, stack, swiglu=True, layer=layer
        ),
    )


@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not native.PACKED_MATMULS[name].available(), reason=f"no {name} here"
            ),
        )
        for name in native.GROUPED_TARGETS
    ],
)
def test_grouped_matmul_reads_its_layer(kernel):
    spec = native.PACKED_MATMULS[kernel]
    rng = np.random.default_rng(3)
    experts = rng.standard_normal((LAYERS, 4, 32, 48)).astype(np.float32).astype(spec.dtype)
    stack = jnp.asarray(np.stack([native.pack_experts(kernel, e) for e in experts]))
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    sizes = jnp.asarray([3, 0, 4, 1], jnp.int32)
    _each_layer_agrees(
        lambda layer: native.packed_grouped_matmul(kernel, x, stack[layer], sizes),
        lambda layer: native.packed_grouped_matmul(kernel, x, stack, sizes, layer),
    )


@pytest.mark.parametrize("kernel", FLOAT_KERNELS[-1:])
def test_a_layer_off_the_stack_is_an_error(kernel):
    spec = native.PACKED_MATMULS[kernel]
    stack = jnp.asarray(_stack(spec, 32, 16))
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(Exception, match="layer i32\\[1\\] in range"):
        jax.block_until_ready(native.packed_matmul(kernel, x, stack, None, jnp.int32(LAYERS)))
