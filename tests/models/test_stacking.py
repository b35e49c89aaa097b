"""Layers stacked per run and looped over by a scan (models/stacking.py): the runs and the
scanned segments, and deeper models than the parity test's (whose two or three layers leave
Gemma's local/global pattern and a MoE's dense first layer to the unrolled path) giving
transformers' tokens both scanned and unrolled."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import hf_greedy, make_hf_model, random_prompts

from jaxcb import LLM, SamplingParams
from jaxcb.models.base import ParamInfo
from jaxcb.models.stacking import layer_runs, run_layers, segments, stack_layers

W = 48  # a sliding window


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        ([None] * 5, [(0, 5, 1)]),  # Llama: one scan over every layer
        ([W, None] * 3, [(0, 6, 2)]),  # Gemma 2: local, global
        ([W, None, W, None, W], [(0, 4, 2), (4, 1, 1)]),
        ([W] * 5 + [None], [(0, 5, 1), (5, 1, 1)]),  # not repeated: no period of 6
        (([W] * 5 + [None]) * 4 + [W] * 2, [(0, 24, 6), (24, 2, 1)]),  # Gemma 3, 26 layers
        ([None] * 3 + [W] * 4, [(0, 3, 1), (3, 4, 1)]),  # Qwen's max_window_layers
        ([W], [(0, 1, 1)]),
    ],
)
def test_segments_scan_the_repeating_pattern(kinds, expected):
    assert segments(kinds) == expected


def test_runs_split_where_the_weights_differ():
    dense = {"w": np.zeros((4, 8), np.float32), "norm": np.ones(4, np.float32)}
    sparse = {"w": np.zeros((2, 4, 8), np.float32), "norm": np.ones(4, np.float32)}
    q8 = {"w": {"int8": np.zeros((1, 2, 576), np.uint8)}, "norm": np.ones(4, np.float32)}
    q4 = {"w": {"int4": np.zeros((1, 2, 320), np.uint8)}, "norm": np.ones(4, np.float32)}
    assert layer_runs([dense, sparse, sparse, sparse]) == [1, 3]
    assert layer_runs([q8, q8, q4, q8]) == [2, 1, 1]  # a GGUF file's mixed blocks


def test_stack_layers_stacks_params_and_their_declarations():
    layers = [{"w": np.full((4, 8), i, np.float32)} for i in range(3)]
    info = {"w": ParamInfo((4, 8), ("embed", "mlp"), matmul=True)}
    params, infos = stack_layers({"layers": layers, "embed": 1}, {"layers": [info] * 3})
    (stack,) = params["layers"]
    assert stack["w"].shape == (3, 4, 8) and (stack["w"][2] == 2).all()
    assert params["embed"] == 1 and len(layers) == 3  # new dicts; the input is untouched
    assert infos["layers"] == [{"w": ParamInfo((3, 4, 8), ("layers", "embed", "mlp"), True)}]
    abstract = [{"w": jax.ShapeDtypeStruct((4, 8), np.float32)}] * 2
    (stack,) = stack_layers({"layers": abstract}, {"layers": [info] * 2})[0]["layers"]
    assert stack["w"].shape == (2, 4, 8)


DEEP = {
    # local, global, local, global, local: a scan over two (local, global) groups, one more
    "gemma2": {"num_hidden_layers": 5},
    # layer 0 dense, layers 1-3 sparse: two runs, the sparse one scanned
    "qwen3-moe": {"num_hidden_layers": 4},
    "llama3": {"num_hidden_layers": 4},
}


def test_unrolled_layers_are_traced_once_per_kind():
    # Six layers, local and global alternating: every layer runs in order on its own params
    # and pool, but layer_fn is traced twice (one per kind), not six times.
    kinds = ("local", "global") * 3
    traced: list[int] = []

    def layer_fn(layer, carry, index, kind_index):
        traced.append(kind_index)
        x, pools = carry
        scale = 2.0 if kinds[kind_index] == "global" else 1.0
        pools = [*pools[:index], pools[index] + x.sum(), *pools[index + 1 :]]
        return x * layer["w"] * scale + pools[index], pools

    layers = [{"w": jax.numpy.float32(i + 1)} for i in range(6)]
    pools = [jax.numpy.zeros((2,)) for _ in range(6)]

    def run(x, layers, pools):
        return run_layers(layers, (x, pools), layer_fn, kinds=kinds, scan=False)

    x, pools = jax.jit(run)(jax.numpy.ones((2,)), layers, pools)
    assert sorted(traced) == [0, 1]
    want_x, want_pools = np.ones(2), []
    for i in range(6):  # the same layers in Python, one after another
        pool = want_x.sum()
        want_x = want_x * (i + 1) * (2.0 if i % 2 else 1.0) + pool
        want_pools.append(np.full(2, pool))
    np.testing.assert_allclose(np.asarray(x), want_x, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pools), np.asarray(want_pools), rtol=1e-6)


@pytest.mark.parametrize("family", sorted(DEEP))
def test_scanned_and_unrolled_give_transformers_tokens(family, tmp_path):
    model = make_hf_model(family, tmp_path, **DEEP[family])
    prompts = random_prompts(4, seed=5, max_len=90)
    expected = [hf_greedy(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for scan in (True, False):
        llm = LLM(
            tmp_path,
            scan_layers=scan,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            token_buckets=[64],
            max_model_len=128,
            num_pages=32,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected, f"scan_layers={scan}"
