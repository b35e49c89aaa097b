"""Sampling compiled for absent accelerators: no sort over the vocabulary or the penalties."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.sampling import apply_penalties, sample


@pytest.mark.parametrize("target", ["v5e:2x2", "h100"])
def test_compiled_for_accelerators_without_a_vocabulary_sort(target):
    """`sample` (penalties, filters, top-20 logprobs) compiled for a TPU and an H100 on
    compile-only devices holds no sort over the vocabulary: XLA sorts a row for lax.top_k(x,
    1024) on both at this size and for top-20 on GPUs, as the code before issue 18 showed."""
    from pallas_kernels.gpu_targets import cuda_plugin_installed

    if target == "h100" and not cuda_plugin_installed():
        pytest.skip("jax[cuda12] is not installed")
    if target != "h100" and importlib.util.find_spec("libtpu") is None:
        pytest.skip("jax[tpu] (libtpu) is not installed")
    from jaxcb.runtime import aot

    sharding = jax.sharding.SingleDeviceSharding(aot.target_devices(target)[0])
    rows, vocab = 8, 4096

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    f32, i32 = jnp.float32, jnp.int32
    per_row = dict(temperature=f32, top_k=i32, top_p=f32, min_p=f32, sample_counters=i32)
    kwargs = {name: spec((rows,), dtype) for name, dtype in per_row.items()}
    penalty_args = (spec((rows, 64), i32), spec((rows, 64), f32))
    penalty_args += tuple(spec((rows,), f32) for _ in range(3))
    lowered = jax.jit(sample, static_argnames="num_top_logprobs").lower(
        spec((rows, vocab), f32),
        rng_keys=spec((rows, 2), jnp.uint32),
        flags=spec((4,), i32),
        penalty_args=penalty_args,
        num_top_logprobs=20,
        num_rows=spec((), i32),
        **kwargs,
    )
    sorts = [line for line in lowered.compile().as_text().splitlines() if " sort(" in line]
    assert not [line for line in sorts if f"{vocab}]" in line], sorts


def test_penalty_scatter_compiles_for_tpu_without_a_sort():
    """The penalties' scatters into [S, V] logits split over a v5e x4's chips: with the
    history sent as (row, token) pairs that may repeat, XLA sorted all S x M of them (524,288
    here; 2M at the Qwen3-8B preset's shapes); sorted unique pairs need no sort."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("jax[tpu] (libtpu) is not installed")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxcb.runtime import aot

    mesh = Mesh(np.array(aot.target_devices("v5e:2x2")[:4]), ("tp",))
    replicated = NamedSharding(mesh, PartitionSpec())
    rows, history, vocab = 256, 2048, 65536

    def penalize(logits, *args):
        split = NamedSharding(mesh, PartitionSpec(None, "tp"))
        return apply_penalties(jax.lax.with_sharding_constraint(logits, split), *args)

    shapes = [((rows, vocab), jnp.float32), ((rows, history), jnp.int32)]
    shapes += [((rows, history), jnp.float32)] + [((rows,), jnp.float32)] * 3
    args = [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in shapes]
    with jax.set_mesh(mesh):
        text = jax.jit(penalize).lower(*args).compile().as_text()
    assert not [line for line in text.splitlines() if " sort(" in line]
