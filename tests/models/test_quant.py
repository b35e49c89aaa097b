"""int8 weight quantization: round-trip bounds, block grids, the matmul, declarations, config
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.config import EngineConfig
from jaxcb.models import registry
from jaxcb.models.base import abstract_from_infos
from jaxcb.models.loading.default_model import CONFIG
from jaxcb.models.quant import (
    CODE_OFFSET,
    GROUP_SIZE,
    channel_matmul,
    dequantize,
    dequantize_np,
    int8_matmul,
    quantize_fp8,
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
    assert set(qw) == {"q", "scale", "min"}
    assert qw["q"].dtype == np.int8 and qw["q"].shape == shape
    for part in ("scale", "min"):
        assert qw[part].shape == (groups, *shape[1:]) and qw[part].dtype == np.float16
    # each group's minimum and maximum land on the ends of the codes 0..255
    grouped = qw["q"].reshape(groups, -1, *shape[1:])
    assert (grouped.min(axis=1) == -CODE_OFFSET).all() and (grouped.max(axis=1) == 127).all()
    # half a step, and the float16 rounding of the group's minimum
    size = shape[0] // groups
    step = np.repeat(qw["scale"].astype(np.float32), size, axis=0)
    lo = w.reshape(groups, size, *shape[1:]).min(axis=1)
    shift = np.repeat(np.abs(lo - qw["min"].astype(np.float32)), size, axis=0)
    back = dequantize_np(qw)
    assert back.dtype == np.float32 and back.shape == shape
    assert np.all(np.abs(back - w) <= step / 2 + shift + 1e-6 * np.abs(w))
    # the device's dequantize is the host's
    np.testing.assert_allclose(np.asarray(dequantize(qw)), back, rtol=1e-6, atol=1e-7)


def test_constant_groups_and_float16_scales_whatever_the_weight_dtype():
    w = np.zeros((64, 4), np.float32)
    w[32:, 1] = 5.0
    w[:32, 2] = 0.1  # not a float16: the minimum's rounding is the error
    qw = quantize_int8(jnp.asarray(w, jnp.bfloat16))
    assert qw["scale"].dtype == qw["min"].dtype == np.float16
    assert (qw["scale"][:, :3] == 0).all()  # constant groups: no step
    back = dequantize_np(qw)
    np.testing.assert_array_equal(back[:, [0, 1, 3]], w[:, [0, 1, 3]])  # exact
    bf16 = float(jnp.asarray(0.1, jnp.bfloat16))
    np.testing.assert_array_equal(back[:32, 2], np.float32(np.float16(bf16)))


def q4_1_weight(seed=2):
    """GGUF Q4_1-like weights: float16 d and m per block of 32 inputs, d x {0..15} + m in
    float32 (as gguf dequantizes), each block using its whole range. (w, d, m, levels)."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.01, 0.1, (2, 8)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-1, 0, (2, 8)).astype(np.float16).astype(np.float32)
    levels = rng.integers(0, 16, (2, 32, 8))
    levels[:, 0], levels[:, 1] = 0, 15
    w = (d[:, None] * levels.astype(np.float32) + m[:, None]).reshape(64, 8)
    return w, d, m, levels


def test_a_q4_1_block_grid_is_held():
    """Without the grid, each of the 16 levels is 17 codes apart: held to the float16
    rounding of the scale and minimum. With it (the blocks' own d and m per element), the
    codes are the levels and the weight comes back bit for bit."""
    w, d, m, levels = q4_1_weight()
    back = dequantize_np(quantize_int8(w))
    np.testing.assert_allclose(back, w, rtol=0, atol=2e-3)
    grid = (np.repeat(d, 32, axis=0), np.repeat(m, 32, axis=0))
    qw = quantize_int8(w, grid)
    np.testing.assert_array_equal(qw["q"], (levels - CODE_OFFSET).reshape(64, 8))
    np.testing.assert_array_equal(qw["scale"], d.astype(np.float16))
    np.testing.assert_array_equal(qw["min"], m.astype(np.float16))
    np.testing.assert_array_equal(dequantize_np(qw), w)


def test_a_q4_0_grid_with_negative_scales_is_held():
    """A Q4_0 block's d is its largest-magnitude value / -8: negative where that is positive.
    The scale keeps its sign (code q4 at min -8 d) and the codes stay the block's."""
    rng = np.random.default_rng(4)
    d = (rng.uniform(0.01, 0.1, (2, 8)) * rng.choice([-1, 1], (2, 8))).astype(np.float16)
    levels = rng.integers(0, 16, (2, 32, 8))
    D = np.repeat(d.astype(np.float32), 32, axis=0)
    w = D * (levels.reshape(64, 8) - 8).astype(np.float32)
    qw = quantize_int8(w, (D, -8 * D))
    np.testing.assert_array_equal(qw["q"], levels.reshape(64, 8) - CODE_OFFSET)
    np.testing.assert_array_equal(qw["scale"], d)
    assert (qw["scale"] < 0).any()
    np.testing.assert_array_equal(dequantize_np(qw), w)
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), w)


def test_a_grid_that_does_not_fit_falls_back_to_the_range():
    """NaN (a tensor stored otherwise), a scale that varies inside a group (blocks along
    another axis), a scale that is no float16, or values off the grid: quantized anew."""
    w, d, m, _ = q4_1_weight()
    plain = quantize_int8(w)
    D, M = np.repeat(d, 32, axis=0), np.repeat(m, 32, axis=0)
    nan = np.full_like(D, np.nan)
    varying = D.copy()
    varying[5] *= 2
    off = w.copy()
    off[3, 3] += D[3, 3] / 3
    for grid, x in [
        ((nan, nan), w),
        ((varying, M), w),
        ((D + 1e-5, M), w),
        ((D, M), off),
    ]:
        got, want = quantize_int8(x, grid), quantize_int8(x)
        for k in ("q", "scale", "min"):
            np.testing.assert_array_equal(got[k], want[k])
    assert not np.array_equal(plain["scale"], d.astype(np.float16))


def test_matmul_is_the_dot_with_the_dequantized_weight():
    w, x = weight((64, 2, 12)), np.random.default_rng(1).standard_normal((5, 64))
    qw = quantize_int8(jnp.asarray(w))
    got = np.asarray(jax.jit(int8_matmul)(jnp.asarray(x, jnp.float32), qw))
    want = x @ dequantize_np(qw).reshape(64, -1)
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
        assert set(layer[name]) == {"q", "scale", "min"} and layer[name]["q"].dtype == np.int8
        assert info[name]["q"].dtype == "int8"
        assert info[name]["scale"].dtype == info[name]["min"].dtype == "float16"
        assert info[name]["scale"].axes == info[name]["min"].axes == info[name]["q"].axes
        assert info[name]["q"].matmul and not info[name]["scale"].matmul
    assert layer["attn_norm"] is params["layers"][0]["attn_norm"]
    assert qparams["embed"] is params["embed"]  # the table and the head stay as they are
    assert quantized_infos(infos, "int8") == qinfos
    abstract = abstract_from_infos(qinfos, jnp.bfloat16)
    assert abstract["layers"][0]["wo"]["q"].dtype == jnp.int8
    assert abstract["layers"][0]["wo"]["scale"].dtype == jnp.float16
    assert abstract["layers"][0]["wo"]["min"].dtype == jnp.float16
    assert abstract["layers"][0]["attn_norm"].dtype == jnp.bfloat16
    assert quantize_params(params, infos, "none") == (params, infos)


def test_a_tied_table_is_quantized_as_the_head():
    """int8 on CPU: a tied embedding table gets a quantized head of its own ([H, V], int8
    groups of 32 along H: each token's row), which the CPU keeps instead of the table
    (cpu_params.prepare_cpu_params); the declarations say so, and GPU/TPU keep the table."""
    spec = registry.spec_from_hf_config({**CONFIG, "tie_word_embeddings": True})
    infos = registry.param_infos(spec)
    assert "lm_head" not in infos
    abstract = registry.abstract_params(spec, jnp.float32)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda a: rng.standard_normal(a.shape).astype(np.float32), abstract
    )
    qparams, qinfos = quantize_params(params, infos, "int8")
    head, table = qparams["lm_head"], params["embed"]
    assert set(head) == {"q", "scale", "min"} and head["q"].shape == table.T.shape
    step = (table.max() - table.min()) / 255
    assert np.abs(dequantize_np(head) - table.T).max() <= step
    assert qinfos["lm_head"]["q"].axes == ("embed", "vocab")
    assert quantized_infos(infos, "int8") == qinfos
    gpu, gpu_infos = quantize_params(params, infos, "int8", platform="gpu")
    assert "lm_head" not in gpu and "lm_head" not in gpu_infos


def test_quantize_params_holds_the_grids_it_is_given():
    """grids={"layers": [{name: (d, m)}]}: those weights keep their blocks' codes; the
    others are quantized from their range."""
    spec = registry.spec_from_hf_config(CONFIG)
    infos = registry.param_infos(spec)
    abstract = registry.abstract_params(spec, jnp.float32)
    params = jax.tree_util.tree_map(lambda a: np.ones(a.shape, np.float32), abstract)
    shape = infos["layers"][0]["w_down"].shape
    rng = np.random.default_rng(3)
    d = rng.uniform(0.01, 0.1, (shape[0] // 32, *shape[1:])).astype(np.float16)
    codes = rng.integers(1, 256, shape)
    D = np.repeat(d.astype(np.float32), 32, axis=0)
    M = -128 * D  # Q8_0: d x q8, the code q8 + 128
    params["layers"][0]["w_down"] = D * (codes - 128).astype(np.float32)
    grids = {"layers": [{"w_down": (D, M)}] + [{}] * (spec.num_layers - 1)}
    qparams, _ = quantize_params(params, infos, "int8", grids=grids)
    got = qparams["layers"][0]["w_down"]
    np.testing.assert_array_equal(got["q"], codes - CODE_OFFSET)
    np.testing.assert_array_equal(got["scale"], d)
    np.testing.assert_array_equal(dequantize_np(got), params["layers"][0]["w_down"])
    plain, _ = quantize_params(params, infos, "int8")
    np.testing.assert_array_equal(qparams["layers"][0]["wo"]["q"], plain["layers"][0]["wo"]["q"])


def test_bad_quantization_is_a_one_line_error():
    with pytest.raises(ValueError, match="quantization must be one of") as err:
        EngineConfig(quantization="int4")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="quantization must be one of") as err:
        quantized_infos({}, "int4")
    assert "\n" not in str(err.value)


def test_int8_takes_the_per_channel_form_off_cpu():
    """GPU/TPU hold int8 per output channel (fused into the dot there); a checkpoint stored in
    the grouped CPU form is refused there in one line."""
    from jaxcb.models.quant import check_stored, weight_form

    assert weight_form("int8", "cpu") == "int8"
    assert [weight_form("int8", p) for p in ("gpu", "tpu")] == ["int8_channel"] * 2
    assert weight_form("fp8", "tpu") == "fp8" and weight_form("none", "gpu") == "none"
    spec = registry.spec_from_hf_config(CONFIG)
    infos = registry.param_infos(spec)
    abstract = registry.abstract_params(spec, jnp.bfloat16)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda a: rng.normal(size=a.shape).astype(jnp.bfloat16), abstract
    )
    qparams, qinfos = quantize_params(params, infos, "int8", platform="gpu")
    assert qinfos == quantized_infos(infos, "int8", "tpu")
    wo, info = qparams["layers"][0]["wo"], qinfos["layers"][0]["wo"]
    assert set(wo) == {"q", "scale"} and wo["q"].dtype == np.int8
    assert wo["scale"].dtype == jnp.bfloat16 and wo["scale"].shape == (1, *wo["q"].shape[1:])
    assert info["q"].dtype == "int8" and info["scale"].axes[0] == "embed"
    check_stored("int8", "cpu")
    check_stored("none", "tpu")
    for platform in ("tpu", "gpu"):
        with pytest.raises(ValueError, match=r"groups of 32 .* convert it without") as err:
            check_stored("int8", platform)
        assert "\n" not in str(err.value)


def test_per_channel_int8_round_trip_and_matmul():
    """Symmetric per-channel int8: each weight within half a step of its channel's scale;
    channel_matmul (XLA) equals x @ the dequantized weight."""
    from jaxcb.models.quant import quantize_int8_channel

    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 4, 8)).astype(np.float32)
    w[:, 0, 0] = 0.0  # an all-zero channel keeps scale 1 and codes 0
    qw = quantize_int8_channel(w)
    assert qw["q"].dtype == np.int8 and qw["scale"].shape == (1, 4, 8)
    assert np.abs(qw["q"]).max() <= 127 and not qw["q"][:, 0, 0].any()
    deq = qw["q"].astype(np.float32) * qw["scale"]
    assert (np.abs(deq - w) <= qw["scale"] / 2 + 1e-7).all()
    x = rng.normal(size=(5, 64)).astype(np.float32)
    got = np.asarray(jax.jit(channel_matmul)(jnp.asarray(x), qw))
    np.testing.assert_allclose(got, x @ deq.reshape(64, -1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_fp8_weights_round_trip_per_output_channel(dtype):
    """e4m3 codes, one scale per output channel in the weight's dtype: each channel's
    largest magnitude at 448, every weight within e4m3's half step (2^-4 relative, or
    2^-10 x the scale near zero)."""
    w = weight((64, 3, 8)).astype(dtype)
    qw = quantize_fp8(w)
    assert qw["q"].dtype == jnp.float8_e4m3fn and qw["q"].shape == w.shape
    assert qw["scale"].shape == (1, 3, 8) and qw["scale"].dtype == w.dtype
    codes = np.asarray(qw["q"], np.float32)
    np.testing.assert_allclose(np.abs(codes).max(axis=0), 448, rtol=2**-3)
    scale = np.asarray(qw["scale"], np.float32)
    back, w32 = codes * scale, np.asarray(w, np.float32)
    assert np.all(np.abs(back - w32) <= np.maximum(np.abs(w32) * 2**-4, scale * 2**-10))
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    got = np.asarray(jax.jit(channel_matmul)(jnp.asarray(x), qw))
    want = x @ back.reshape(64, -1)
    # (bfloat16: x is rounded to bfloat16 in the dot, as for a plain bfloat16 weight)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_fp8_declarations_keep_the_scale_whole_along_the_input():
    """The per-channel scale is [1, out...]: its first axis is never split (a weight split
    by its input under tensor parallelism keeps every channel's scale on every device)."""
    spec = registry.spec_from_hf_config(CONFIG)
    infos = quantized_infos(registry.param_infos(spec), "fp8")
    wo = infos["layers"][0]["wo"]
    assert set(wo) == {"q", "scale"} and wo["q"].dtype == "float8_e4m3fn"
    assert wo["scale"].shape[0] == 1 and wo["scale"].axes[0] == "embed"
    assert wo["scale"].axes[1:] == wo["q"].axes[1:] and wo["scale"].dtype is None


def test_tensor_parallel_that_splits_a_group_is_a_one_line_error():
    """wo [576, H] split by its input (query heads) under TP: 18 groups of 32 split over 2
    devices, not over 4."""
    from jaxcb.models.base import ParamInfo
    from jaxcb.models.quant import check_tensor_parallel

    infos = {"layers": [{"wo": ParamInfo((576, 64), ("q_heads", "embed"), matmul=True)}]}
    rules = {"q_heads": "tensor", "embed": None}
    qinfos = quantized_infos(infos, "int8")
    check_tensor_parallel(qinfos, rules, 2)
    check_tensor_parallel(qinfos, {**rules, "q_heads": None}, 4)  # not split: fine
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 would split a group") as err:
        check_tensor_parallel(qinfos, rules, 4)
    assert "\n" not in str(err.value) and "wo" in str(err.value)
    check_tensor_parallel(quantized_infos(infos, "fp8"), rules, 4)  # no groups along inputs


def test_fp8_on_a_named_native_cpu_kernel_is_a_one_line_error():
    from jaxcb.runtime.setup import _matmul_backend

    config = EngineConfig.from_dict(None, quantization="fp8", matmul="avx2")
    with pytest.raises(ValueError, match=r"quantization='fp8' has no native CPU kernel") as err:
        _matmul_backend(config, jnp.float32, 1)
    assert "\n" not in str(err.value)
    xla = EngineConfig.from_dict(None, quantization="fp8", matmul="xla")
    assert _matmul_backend(xla, jnp.float32, 1) == "xla"


def _head(form: str, h: int = 64, v: int = 48) -> dict[str, np.ndarray]:
    """A quantized [h, v] head: random int8 groups, Q8_0 blocks (symmetric) or Q4_1 ones."""
    rng = np.random.default_rng(7)
    if form == "int8":
        return quantize_int8(weight((h, v)))
    d = rng.uniform(0.001, 0.05, (h // 32, 1, v)).astype(np.float16).astype(np.float32)
    if form == "q8_0":
        codes, m = rng.integers(-128, 128, (h // 32, 32, v)), np.zeros_like(d)
        grid = (d, -128 * d)
    else:
        codes = rng.integers(0, 16, (h // 32, 32, v))
        m = rng.uniform(-0.3, 0.0, d.shape).astype(np.float16).astype(np.float32)
        grid = (d, m)
    w = (codes * d + m).reshape(h, v).astype(np.float32)
    return quantize_int8(w, tuple(np.broadcast_to(a, (h // 32, 32, v)).reshape(h, v) for a in grid))


@pytest.mark.parametrize("form", ["int8", "q8_0", "q4_1"])
@pytest.mark.parametrize("stored", ["quantized", "packed"])
def test_head_columns_are_the_dequantized_table_rows(form, stored):
    """A tied table read from its quantized head (packed.head_columns): column v of the head
    is token v's embedding, in every form the head is kept in (models/quant.py's, the int8
    kernel's layouts with and without minimums, the 4-bit one)."""
    from jaxcb import native
    from jaxcb.models.packed import head_columns

    qw = _head(form)
    head = {k: jnp.asarray(x) for k, x in qw.items()}
    if stored == "packed":
        kernel = native.INT4_MATMUL if form == "q4_1" else native.INT8_MATMUL
        packed = kernel.pack(qw)
        assert packed.shape[-1] == {"int8": 576, "q8_0": 544, "q4_1": 320}[form]
        head = {kernel.name: jnp.asarray(packed)}
    ids = np.array([0, 47, 5, 16, 31, 5, 17])
    got = np.asarray(jax.jit(head_columns)(head, jnp.asarray(ids)))
    np.testing.assert_array_equal(got, dequantize_np(qw)[:, ids].T)
