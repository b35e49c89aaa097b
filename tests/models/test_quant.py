"""int8 weight quantization: round-trip bounds, the matmul, declarations, config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.config import EngineConfig
from jaxcb.models import registry
from jaxcb.models.base import abstract_from_infos
from jaxcb.models.default_model import CONFIG
from jaxcb.models.quant import (
    GROUP_SIZE,
    dequantize,
    int8_matmul,
    quantize_int8,
    quantize_params,
    quantized_infos,
)


def weight(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, shape[1:])).astype(np.float32)


@pytest.mark.parametrize("shape", [(64, 3, 8), (96, 10), (40, 6)], ids=["3d", "2d", "ungrouped"])
def test_round_trip_within_half_a_step_of_each_group(shape):
    w = weight(shape)
    qw = quantize_int8(jnp.asarray(w))
    groups = shape[0] // GROUP_SIZE if shape[0] % GROUP_SIZE == 0 else 1
    assert qw["q"].dtype == jnp.int8 and qw["q"].shape == shape
    for part in ("scale", "zero"):
        assert qw[part].shape == (groups, *shape[1:]) and qw[part].dtype == jnp.float32
    # each group's minimum and maximum land on the ends of the int8 range
    grouped = np.asarray(qw["q"]).reshape(groups, -1, *shape[1:])
    assert (grouped.min(axis=1) == -128).all() and (grouped.max(axis=1) == 127).all()
    step = np.repeat(np.asarray(qw["scale"]), shape[0] // groups, axis=0)
    err = np.abs(np.asarray(dequantize(qw)) - w)
    assert np.all(err <= step / 2 + 1e-6 * np.abs(w))


def test_constant_groups_and_dtype_follow_the_weight():
    w = np.zeros((64, 4), np.float32)
    w[32:, 1] = 5.0
    qw = quantize_int8(jnp.asarray(w, jnp.bfloat16))
    assert qw["scale"].dtype == jnp.bfloat16
    back = np.asarray(dequantize(qw))
    np.testing.assert_array_equal(back[w == 0], 0.0)  # constant groups stay exact
    np.testing.assert_allclose(back[w != 0], 5.0, rtol=2**-8)  # a bfloat16 zero point


def test_a_q4_1_block_grid_is_held_exactly():
    """GGUF Q4_1 weights (d x {0..15} + m per block of 32) spanning the 16 levels: each level
    is 17 int8 steps apart, so int8 over the same blocks holds them to float rounding."""
    rng = np.random.default_rng(2)
    d, m = rng.uniform(0.01, 0.1, (2, 8)), rng.uniform(-1, 0, (2, 8))
    levels = rng.integers(0, 16, (2, 32, 8))
    levels[:, 0], levels[:, 1] = 0, 15  # each block uses its whole range
    w = (d[:, None] * levels + m[:, None]).reshape(64, 8).astype(np.float32)
    back = np.asarray(dequantize(quantize_int8(jnp.asarray(w))))
    np.testing.assert_allclose(back, w, rtol=0, atol=1e-6)


def test_matmul_is_the_dot_with_the_dequantized_weight():
    w, x = weight((64, 2, 12)), np.random.default_rng(1).standard_normal((5, 64))
    qw = quantize_int8(jnp.asarray(w))
    got = np.asarray(jax.jit(int8_matmul)(jnp.asarray(x, jnp.float32), qw))
    want = x @ np.asarray(dequantize(qw)).reshape(64, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(got - x @ w.reshape(64, -1)).max() < 0.02 * np.abs(x @ w.reshape(64, -1)).max()


def test_quantize_params_takes_the_layer_matmuls_only():
    spec = registry.spec_from_hf_config(CONFIG)
    infos = registry.param_infos(spec)
    abstract = registry.abstract_params(spec, jnp.float32)
    params = jax.tree_util.tree_map(lambda a: np.ones(a.shape, np.float32), abstract)
    qparams, qinfos = quantize_params(params, infos, "int8")
    layer, info = qparams["layers"][0], qinfos["layers"][0]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert set(layer[name]) == {"q", "scale", "zero"} and layer[name]["q"].dtype == jnp.int8
        assert info[name]["q"].dtype == "int8" and info[name]["scale"].dtype is None
        assert info[name]["scale"].axes == info[name]["zero"].axes == info[name]["q"].axes
    assert layer["attn_norm"] is params["layers"][0]["attn_norm"]
    assert qparams["embed"] is params["embed"]  # the table and the head stay as they are
    assert quantized_infos(infos, "int8") == qinfos
    abstract = abstract_from_infos(qinfos, jnp.bfloat16)
    assert abstract["layers"][0]["wo"]["q"].dtype == jnp.int8
    assert abstract["layers"][0]["wo"]["scale"].dtype == jnp.bfloat16
    assert quantize_params(params, infos, "none") == (params, infos)


def test_bad_quantization_and_native_kernels_are_one_line_errors():
    from jaxcb.runtime.setup import _matmul_backend

    with pytest.raises(ValueError, match="quantization must be one of") as err:
        EngineConfig(quantization="int4")
    assert "\n" not in str(err.value)
    config = EngineConfig.from_dict(None, quantization="int8", matmul="avx2")
    with pytest.raises(ValueError, match=r"kernels\.matmul='avx2' cannot run quantization='int8'"):
        _matmul_backend(config, jnp.float32, 1)
    assert _matmul_backend(EngineConfig(quantization="int8"), jnp.float32, 1) == "xla"


def test_int8_is_refused_off_cpu_in_one_line():
    from jaxcb.models.quant import check_platform

    check_platform("int8", "cpu")
    check_platform("none", "tpu")
    for platform in ("tpu", "gpu", "cuda"):
        with pytest.raises(ValueError, match="runs on CPU only") as err:
            check_platform("int8", platform)
        assert "\n" not in str(err.value)
