"""A pool stacked over the layers (a scan's KV pool: layer l's pages at l * P ...) holds
L times a layer's pages; the Pallas kernels' declared cost counts one layer's, as for the
pool of one layer, when told `pool_layers`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxcb.runtime.aot_report import declared_kernel_costs
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

HEADS, KV_HEADS, DIM, PAGE, PAGES, SEQS, PER_SEQ, LAYERS = 8, 2, 128, 16, 64, 32, 16, 8


def kernel_cost(backend: str, num_pages: int, pool_layers: int) -> tuple[int, float, float]:
    def call(q, k, v, lens, table, cu, n):
        return ragged_paged_attention(
            q, k, v, lens, table, cu, n, sm_scale=DIM**-0.5, backend=backend,
            interpret=True, pool_layers=pool_layers,
        )  # fmt: skip

    pages = jax.ShapeDtypeStruct((KV_HEADS, num_pages, PAGE, DIM), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((SEQS, HEADS, DIM), jnp.bfloat16),
        pages,
        pages,
        jax.ShapeDtypeStruct((SEQS,), jnp.int32),
        jax.ShapeDtypeStruct((SEQS, PER_SEQ), jnp.int32),
        jax.ShapeDtypeStruct((SEQS + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    return declared_kernel_costs(jax.make_jaxpr(call)(*args).jaxpr)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_stacked_pool_declares_one_layers_cost(backend):
    one_layer = kernel_cost(backend, PAGES, 1)
    assert one_layer[0] >= 1 and one_layer[2] > 0
    assert kernel_cost(backend, LAYERS * PAGES, LAYERS) == one_layer
    # (without pool_layers the stacked pool counts as a larger pool: more live KV per step)
    assert kernel_cost(backend, LAYERS * PAGES, 1)[2] > one_layer[2]
