"""jaxcb's bfloat16 AMX matmul (jaxcb/native): the packed weight layout, the kernel against
XLA's dot, and the engine choosing it (kernels.matmul). Kernel tests skip on CPUs without
AMX; the layout and the choice are checked everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb import LLM, SamplingParams, native
from jaxcb.runtime.runner import matmul_backend

needs_amx = pytest.mark.skipif(not native.amx_available(), reason="no AMX on this CPU")


def test_pack_layout():
    """Block (n, k), row r, lane 2c + p holds w[32k + 2r + p, 16n + c]."""
    k, n = 64, 48
    w = np.arange(k * n, dtype=np.float32).reshape(k, n).astype(jnp.bfloat16)
    packed = native.pack_amx(w)
    assert packed.shape == (n // 16, k // 32, 16, 32)
    rng = np.random.default_rng(0)
    for _ in range(50):
        nb, kb, r, c, p = (int(rng.integers(s)) for s in (n // 16, k // 32, 16, 16, 2))
        assert packed[nb, kb, r, 2 * c + p] == w[32 * kb + 2 * r + p, 16 * nb + c]


def test_pack_rejects_shapes_off_the_tiles():
    assert native.can_pack_amx((64, 48)) and not native.can_pack_amx((48, 64))
    with pytest.raises(ValueError, match="K must divide by 32 and N by 16"):
        native.pack_amx(np.zeros((64, 40), jnp.bfloat16))


@needs_amx
@pytest.mark.parametrize(
    "m, k, n",
    [(1, 32, 16), (7, 64, 48), (16, 64, 16), (33, 96, 80), (64, 512, 768), (130, 256, 96)],
)
def test_matmul_matches_xla_dot(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    expected = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    got = jax.jit(native.matmul_amx)(x, jnp.asarray(native.pack_amx(np.asarray(w))))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)


def test_matmul_backend_choice():
    f32 = matmul_backend("auto", dtype=jnp.float32, tensor_parallel_size=1)
    assert f32 == "xla"  # float32 weights keep XLA's float32 dot (parity with transformers)
    assert matmul_backend("xla", dtype=jnp.bfloat16, tensor_parallel_size=1) == "xla"
    assert matmul_backend("auto", dtype=jnp.bfloat16, tensor_parallel_size=2) == "xla"
    with pytest.raises(ValueError, match="not bfloat16"):
        matmul_backend("amx", dtype=jnp.float32, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="tensor parallelism"):
        matmul_backend("amx", dtype=jnp.bfloat16, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="matmul must be one of"):
        LLM(matmul="onednn")


@needs_amx
def test_engine_on_amx_matches_xla_matmuls():
    """The same bf16 engine with its matmuls on the AMX kernel and on XLA: same greedy tokens
    and logprobs (both multiply bf16 and accumulate in float32)."""
    config = dict(
        dtype="bfloat16",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=[16, 64],
        num_pages=64,
        max_model_len=256,
        attention="native",
    )
    amx = LLM(matmul="amx", **config)
    xla = LLM(matmul="xla", **config)
    assert (amx.engine.matmul_backend, xla.engine.matmul_backend) == ("amx", "xla")
    layer = amx.engine.runner.params["layers"][0]
    assert all(isinstance(layer[name], dict) for name in ("wqkv", "wo", "w_gate_up", "w_down"))
    prompts = [[10, 11, 12, 13], list(range(40, 90))]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for a, b in zip(
        amx.generate(prompts, sp, use_tqdm=False),
        xla.generate(prompts, sp, use_tqdm=False),
        strict=True,
    ):
        assert a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4]
