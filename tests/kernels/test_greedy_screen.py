"""The screened greedy LM head (kernels.greedy_screen): the argmax of a float32 matmul found
with a bf16 matmul plus a float32 recheck of the few columns the error bound leaves open.
It must return exactly the tokens of the float32 kernel (first column on ties), whatever the
margins between logits, and the engine must give the same tokens with and without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_MODEL, random_prompts

from jaxcb import LLM, SamplingParams, native

#: The float32 kernels (each ISA level's screen: vdpbf16ps where the CPU has it, else the
#: bf16 screen widened in registers), skipped where this CPU cannot run them.
F32_KERNELS = [
    pytest.param(
        name, marks=pytest.mark.skipif(not spec.available(), reason=f"no {name} on this CPU")
    )
    for name, spec in native.PACKED_MATMULS.items()
    if spec.dtype == jnp.float32
]
pytestmark = pytest.mark.parametrize("kernel", F32_KERNELS)


def exact_argmax(kernel: str, *args):
    return jax.jit(native.PACKED_MATMULS[kernel].argmax)(*args)


def screened_argmax(kernel: str, *args):
    return jax.jit(lambda *a: native.matmul_argmax_screened_f32(*a, kernel=kernel))(*args)


def _pack(w: np.ndarray) -> tuple[jax.Array, dict[str, jax.Array]]:
    screen = {k: jnp.asarray(v) for k, v in native.pack_argmax_screen(w).items()}
    return jnp.asarray(native.pack_f32(w)), screen


def _near_ties(rng: np.random.Generator, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Random columns, and groups of columns that differ from one another by a few float32
    ulps: bf16 cannot tell them apart (their screen values are equal or out of order), only
    the float32 recheck can. Groups span a 16-column block and several work items. Returns
    the weight and each group's first column."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    bases = rng.choice(n, size=min(24, n), replace=False)
    for base in bases:
        for col in (base + 1, base + 17, (base + n // 2) % n, (base + 3 * n // 4) % n):
            if col < n:
                eps = rng.integers(-4, 5, size=k).astype(np.float32) * np.float32(2**-22)
                w[:, col] = w[:, base] * (1 + eps)
    return w, bases


@pytest.mark.parametrize(
    "m, k, n", [(1, 32, 16), (5, 64, 48), (13, 128, 4000), (130, 96, 2048), (70, 512, 32000)]
)
def test_screened_argmax_is_the_float32_argmax(kernel, m, k, n):
    rng = np.random.default_rng(m * k + n)
    w, bases = _near_ties(rng, k, n)
    # Rows pointing at the near-tie groups make their members the top logits.
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[::2] = w[:, rng.choice(bases, size=len(x[::2]))].T * 4 + x[::2] * 0.01
    w_packed, screen = _pack(w)
    x = jnp.asarray(x)
    logits, want = exact_argmax(kernel, x, w_packed)
    out, got = screened_argmax(kernel, x, w_packed, screen)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The first output is the product of the bf16-rounded rows and weights.
    x_bf16 = np.asarray(x.astype(jnp.bfloat16), np.float32)
    w_bf16 = w.astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_allclose(np.asarray(out), x_bf16 @ w_bf16, rtol=1e-4, atol=1e-3)
    # Sanity: the test does not pass trivially: greedy on the bf16 products alone would
    # have picked other tokens (except for the smallest cases).
    if m >= 13:
        assert (np.asarray(out).argmax(axis=1) != np.asarray(want)).any()
    assert (np.asarray(logits).argmax(axis=1) == np.asarray(want)).all()


def test_exact_ties_and_degenerate_rows(kernel):
    """Equal float32 maxima go to the first column, in one block or across blocks; a zero
    row ties everywhere (token 0); a row with a NaN or an infinity costs a full float32 scan
    and leaves the other rows alone; bf16-exact weights make the weight error bound 0."""
    rng = np.random.default_rng(0)
    k, n = 64, 4000
    w = rng.standard_normal((k, n)).astype(jnp.bfloat16).astype(np.float32)  # bf16-exact
    w[:, 2500] = w[:, 3001] = w[:, 3007] = w[:, 40]
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[0] = w[:, 40] * 3
    x[1] = 0
    x[2, 5] = np.nan
    x[3, 7] = np.inf
    x[4] = w[:, 3001] * 3 + 1e-3
    w_packed, screen = _pack(w)
    assert (np.asarray(screen["screen_stats"])[1] < 1e-40).all()  # ||bf16(w_j) - w_j|| ~ 0
    _, want = exact_argmax(kernel, jnp.asarray(x), w_packed)
    _, got = screened_argmax(kernel, jnp.asarray(x), w_packed, screen)
    got, want = np.asarray(got), np.asarray(want)
    assert got[0] == want[0] == 40 and got[1] == want[1] == 0
    assert got[4] == want[4] and got[5] == want[5]
    assert 0 <= got[2] < n and 0 <= got[3] < n


@pytest.mark.parametrize("rows", [0, 3, 9])
def test_padding_rows_get_token_zero(kernel, rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((64, 480)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.float32) + 1.0
    w_packed, screen = _pack(w)
    out, ids = screened_argmax(kernel, x, w_packed, screen, jnp.int32(rows))
    _, full = exact_argmax(kernel, x, w_packed)
    assert np.asarray(ids).tolist() == np.asarray(full)[:rows].tolist() + [0] * (9 - rows)
    assert not np.asarray(out)[rows:].any()


def test_column_statistics_bound_the_columns(kernel):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    stats = native.pack_argmax_screen(w)["screen_stats"]
    w64 = w.astype(np.float64)
    err = w.astype(jnp.bfloat16).astype(np.float64) - w64
    norms, errs = np.linalg.norm(w64, axis=0), np.linalg.norm(err, axis=0)
    assert (stats[0] >= norms).all() and (stats[0] <= norms * (1 + 1e-5)).all()
    assert (stats[1] >= errs).all() and (stats[1] <= errs * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match="K must divide by 32, N by 16"):
        native.pack_argmax_screen(np.zeros((48, 32), np.float32))


def test_engine_gives_the_same_tokens_with_and_without_the_screen(kernel):
    """Greedy requests alone (the screen), mixed with sampled and logprob requests (the full
    float32 LM head), and penalties: every output, token ids and logprobs, is the same."""
    config = dict(
        model=TINY_MODEL,
        dtype="float32",
        matmul=kernel,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        token_buckets=[16, 64],
        num_pages=96,
        max_model_len=256,
        compilation_cache="off",
    )
    screened = LLM(greedy_screen=True, **config)
    plain = LLM(greedy_screen=False, **config)
    assert "lm_head_screen" in screened.engine.runner.params
    assert "lm_head_screen" not in plain.engine.runner.params
    prompts = random_prompts(12, seed=0, max_len=40, vocab=300)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    mixed = [
        greedy,
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    ] * 3
    for params in (greedy, mixed):
        a = screened.generate(prompts, params, use_tqdm=False)
        b = plain.generate(prompts, params, use_tqdm=False)
        for x, y in zip(a, b, strict=True):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            assert x.outputs[0].logprobs == y.outputs[0].logprobs
    tokens = {t for out in a for t in out.outputs[0].token_ids}
    assert len(tokens) > 20  # diverse output: the comparison means something
