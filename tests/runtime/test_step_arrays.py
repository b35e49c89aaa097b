"""The jitted step's arrays: StepInput travels as two buffers plus its large arrays
(step_input.pack_small), the weights as one stack per run of layers, the KV pool as one
array per K and V: a handful whatever the model's depth."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from helpers import TINY_MODEL

from jaxcb import LLM
from jaxcb.engine.buckets import Bucket
from jaxcb.runtime.step_input import (
    LARGE_FIELDS,
    StepInput,
    empty_step_input,
    pack_small,
    small_layout,
    unpack_small,
)


def test_small_arrays_round_trip_through_two_buffers():
    inp = empty_step_input(Bucket(8, 4), pages_per_seq=3, max_model_len=16, vocab_size=40)
    rng = np.random.default_rng(0)
    for f in dataclasses.fields(StepInput):
        value = getattr(inp, f.name)
        if f.name not in LARGE_FIELDS:  # distinct values everywhere, rng_keys' top bit set
            high = 2**32 if value.dtype == np.uint32 else 1000
            setattr(inp, f.name, rng.integers(0, high, value.shape).astype(value.dtype))
    ints, floats = pack_small(inp)
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    large = tuple(getattr(inp, name) for name in LARGE_FIELDS)
    layout = small_layout(inp)
    out = jax.jit(unpack_small, static_argnums=3)(ints, floats, large, layout)
    for f in dataclasses.fields(StepInput):
        want, got = getattr(inp, f.name), getattr(out, f.name)
        assert got.dtype == jnp.asarray(want).dtype and got.shape == want.shape, f.name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f.name)


def test_the_compiled_step_takes_a_handful_of_arrays():
    llm = LLM(
        TINY_MODEL,
        token_buckets=[16],
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        num_pages=16,
    )
    runner = llm.engine.runner
    (compiled,) = [runner.programs.compiled_step(b) for b in llm.engine.info.buckets]
    args = jax.tree_util.tree_leaves(compiled.args_info)
    results = jax.tree_util.tree_leaves(compiled.out_info)
    weights = jax.tree_util.tree_leaves(runner.params)
    assert len(jax.tree_util.tree_leaves(runner.state)) == 2  # K and V of every layer
    assert len(runner.params["layers"]) == 1  # one stacked run
    # the weights, the pool, two StepInput buffers and its large arrays
    assert len(args) == len(weights) + 2 + 2 + len(LARGE_FIELDS)
    assert len(args) + len(results) <= 40
