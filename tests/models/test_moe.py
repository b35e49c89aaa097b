"""The mixture-of-experts family (models/moe.py) piece by piece, against plain numpy: the
grouped expert computation (models/experts.py), the router, the shared expert, padding rows,
the config mapping and the sharding of the expert weights. Greedy parity with transformers
is in tests/e2e/test_parity.py (mixtral, qwen2-moe, qwen3-moe)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcb.models import moe
from jaxcb.models.experts import experts_ffn, sort_by_expert
from jaxcb.models.registry import param_infos, spec_from_hf_config
from jaxcb.models.weights import ModelLoadError
from jaxcb.runtime import sharding

H, E, F, S = 16, 4, 8, 12  # hidden, experts, each expert's FFN size, the shared expert's
CONFIG = dict(
    architectures=["Qwen2MoeForCausalLM"],
    vocab_size=64,
    hidden_size=H,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=E,
    num_experts_per_tok=2,
    moe_intermediate_size=F,
    shared_expert_intermediate_size=S,
)
SPEC = spec_from_hf_config(CONFIG)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def expert_weights(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    gate_up = rng.normal(0, 0.3, (E, H, 2, F)).astype(np.float32)
    down = rng.normal(0, 0.3, (E, F, H)).astype(np.float32)
    return gate_up, down


def reference_ffn(h, weights, experts, gate_up, down) -> np.ndarray:
    """Expert by expert in numpy: each expert's tokens through its SwiGLU, weighted, added."""
    out = np.zeros_like(h, dtype=np.float64)
    for e in range(E):
        tokens, slots = np.nonzero(experts == e)
        x = h[tokens].astype(np.float64)
        act = silu(x @ gate_up[e, :, 0]) * (x @ gate_up[e, :, 1])
        np.add.at(out, tokens, (act @ down[e]) * weights[tokens, slots][:, None])
    return out


def run_ffn(h, weights, experts, gate_up, down, real_tokens: int) -> np.ndarray:
    fn = jax.jit(experts_ffn, static_argnums=5)
    out = fn(h, weights, experts.astype(np.int32), gate_up, down, E, jnp.int32(real_tokens))
    return np.asarray(out)


def test_grouped_experts_equal_a_per_expert_loop() -> None:
    """Expert 1 gets every token, expert 3 none; the rest split the second slot."""
    rng = np.random.default_rng(0)
    t = 10
    h = rng.normal(size=(t, H)).astype(np.float32)
    experts = np.stack([np.ones(t, int), rng.choice([0, 2], size=t)], axis=1)
    experts[::3] = experts[::3, ::-1]  # the all-tokens expert in either slot
    weights = rng.uniform(0.1, 1.0, (t, 2)).astype(np.float32)
    gate_up, down = expert_weights(rng)
    got = run_ffn(h, weights, experts, gate_up, down, t)
    np.testing.assert_allclose(got, reference_ffn(h, weights, experts, gate_up, down), atol=1e-5)


def test_padding_rows_are_in_no_group_and_come_out_zero() -> None:
    rng = np.random.default_rng(1)
    t, real = 8, 5
    h = rng.normal(size=(t, H)).astype(np.float32)
    h[real:] = 1e30  # whatever a bucket's padding holds, it must not reach a real row
    experts = np.stack([rng.permutation(E)[:2] for _ in range(t)])
    weights = rng.uniform(size=(t, 2)).astype(np.float32)
    order, sizes = sort_by_expert(jnp.asarray(experts, jnp.int32), E, jnp.int32(real))
    assert int(sizes.sum()) == real * 2
    assert set(np.asarray(order)[real * 2 :] // 2) == set(range(real, t))  # sorted last
    np.testing.assert_array_equal(sizes, np.bincount(experts[:real].ravel(), minlength=E))
    gate_up, down = expert_weights(rng)
    got = run_ffn(h, weights, experts, gate_up, down, real)
    assert not got[real:].any()
    want = reference_ffn(h[:real], weights[:real], experts[:real], gate_up, down)
    np.testing.assert_allclose(got[:real], want, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_top_k_with_and_without_renormalisation(norm_topk_prob: bool) -> None:
    rng = np.random.default_rng(2)
    spec = dataclasses.replace(SPEC, norm_topk_prob=norm_topk_prob)
    h = rng.normal(size=(9, H)).astype(np.float32)
    router = rng.normal(size=(H, E)).astype(np.float32)
    weights, experts = jax.jit(moe.route, static_argnums=2)(h, router, spec)

    logits = h.astype(np.float64) @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_experts = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
    want = np.take_along_axis(probs, want_experts, axis=-1)
    if norm_topk_prob:
        want /= want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want, rtol=1e-5)
    assert np.allclose(np.asarray(weights).sum(-1), 1.0) == norm_topk_prob


def test_sparse_layer_with_gated_shared_expert() -> None:
    rng = np.random.default_rng(3)
    t, real = 7, 6
    h = rng.normal(size=(t, H)).astype(np.float32)
    gate_up, down = expert_weights(rng)
    layer = {
        "router": rng.normal(size=(H, E)).astype(np.float32),
        "w_experts_gate_up": gate_up,
        "w_experts_down": down,
        "w_shared_gate_up": rng.normal(0, 0.3, (H, 2, S)).astype(np.float32),
        "w_shared_down": rng.normal(0, 0.3, (S, H)).astype(np.float32),
        "shared_gate": rng.normal(size=H).astype(np.float32),
    }
    fn = jax.jit(moe.sparse_mlp, static_argnums=2)
    got = np.asarray(fn(layer, h, SPEC, jnp.int32(real)))

    weights, experts = moe.route(h, layer["router"], SPEC)
    routed = reference_ffn(h, np.asarray(weights), np.asarray(experts), gate_up, down)
    w = layer["w_shared_gate_up"]
    shared = (silu(h @ w[:, 0]) * (h @ w[:, 1])) @ layer["w_shared_down"]
    gate = 1.0 / (1.0 + np.exp(-(h @ layer["shared_gate"])))
    want = routed + gate[:, None] * shared
    np.testing.assert_allclose(got[:real], want[:real], atol=1e-5)


def test_config_mapping() -> None:
    # Qwen: decoder_sparse_step and mlp_only_layers pick the sparse layers
    spec = spec_from_hf_config(
        dict(CONFIG, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert spec.family == "moe" and spec.qkv_bias and not spec.norm_topk_prob
    assert spec.sparse_layers == (False, True, False, False, False, True)
    # what a token passes through, averaged over layers: 4 dense, 2 of k experts + shared
    assert spec.active_intermediate_size == (4 * 24 + 2 * (2 * F + S)) / 6
    infos = param_infos(spec)["layers"]
    assert "w_gate_up" in infos[0] and "w_experts_gate_up" not in infos[0]
    assert infos[1]["w_experts_gate_up"].shape == (E, H, 2, F)
    assert infos[1]["w_shared_gate_up"].shape == (H, 2, S) and "w_gate_up" not in infos[1]
    # Qwen3-MoE saves num_experts as num_local_experts; q/k norms, no shared expert
    qwen3 = dict(CONFIG, architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=True)
    del qwen3["num_experts"]
    spec = spec_from_hf_config(dict(qwen3, num_local_experts=6))
    assert (spec.num_experts, spec.qk_norm, spec.qkv_bias, spec.norm_topk_prob) == (
        6,
        True,
        False,
        True,
    )
    assert spec.shared_expert_intermediate_size == 0 and all(spec.sparse_layers)
    # Mixtral: every layer sparse, experts of intermediate_size, always renormalised
    mixtral = dict(CONFIG, architectures=["MixtralForCausalLM"], num_local_experts=8)
    spec = spec_from_hf_config(mixtral)
    assert (spec.num_experts, spec.moe_intermediate_size, spec.norm_topk_prob) == (8, 24, True)
    assert spec.active_intermediate_size == 2 * 24
    assert "shared_gate" not in param_infos(spec)["layers"][0]
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=5"):
        spec_from_hf_config(dict(CONFIG, num_experts_per_tok=5))


def test_expert_weights_shard_by_their_intermediate_axis() -> None:
    """Per-expert tensor parallelism: every device holds a slice of every expert."""
    layer = param_infos(SPEC)["layers"][0]
    spec_of = {name: sharding.logical_spec(info.axes) for name, info in layer.items()}
    assert spec_of["w_experts_gate_up"] == P(None, None, None, "tensor")
    assert spec_of["w_experts_down"] == P(None, "tensor", None)
    assert spec_of["router"] == P(None, None)
    assert spec_of["w_shared_gate_up"] == P(None, None, "tensor")
    assert spec_of["w_shared_down"] == P("tensor", None)
    assert layer["w_experts_gate_up"].experts and not layer["router"].matmul
    spec = dataclasses.replace(SPEC, num_q_heads=4, num_kv_heads=4)  # heads: TP 4 divides
    sharding.check_tensor_parallel(spec, 4)  # intermediate 24, experts 8, shared expert 12
    with pytest.raises(ValueError, match="does not divide the model's moe_intermediate_size=6"):
        sharding.check_tensor_parallel(dataclasses.replace(spec, moe_intermediate_size=6), 4)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=10"):
        sharding.check_tensor_parallel(
            dataclasses.replace(spec, shared_expert_intermediate_size=10), 4
        )


TP_WORKER = """
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np, jax.numpy as jnp
from jax.sharding import NamedSharding
from jaxcb.models import moe
from jaxcb.models.registry import param_infos
from test_moe import SPEC
from jaxcb.runtime import sharding

infos = param_infos(SPEC)["layers"][0]
rng = np.random.default_rng(4)
layer = {k: rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in infos.items()
         if k in ("router", "shared_gate") or "expert" in k or "shared" in k}
h = rng.normal(size=(11, SPEC.hidden_size)).astype(np.float32)
fn = jax.jit(moe.sparse_mlp, static_argnums=2)
one = np.asarray(fn(layer, h, SPEC, jnp.int32(9)))
mesh = sharding.replica_mesh(2)
split = {k: jax.device_put(v, NamedSharding(mesh, sharding.logical_spec(infos[k].axes)))
         for k, v in layer.items()}
assert split["w_experts_down"].sharding.spec[1] == "tensor"
two = np.asarray(fn(split, h, SPEC, jnp.int32(9)))
np.testing.assert_allclose(two, one, atol=1e-5)
print("ok")
"""


def test_tensor_parallel_sparse_layer_equals_one_device() -> None:
    """The sparse layer with its experts split over 2 (forced CPU) devices: the same output
    as on one (a subprocess: the device count is fixed when jax's backend starts)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([here, root]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TP_WORKER)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
