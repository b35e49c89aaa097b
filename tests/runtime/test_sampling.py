"""On-device sampling: filters keep exactly the allowed tokens, penalties follow vLLM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.sampling import apply_penalties, sample

V = 12


def run(
    logits,
    *,
    temperature,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seeds=None,
    counters=None,
    flags=(1, 0, 0, 0),
    num_rows=None,
):
    s = logits.shape[0]
    seeds = np.arange(s) if seeds is None else np.asarray(seeds)
    keys = np.stack([np.zeros_like(seeds), seeds], axis=1).astype(np.uint32)
    out = jax.jit(sample, static_argnames="num_top_logprobs")(
        jnp.asarray(logits, jnp.float32),
        temperature=jnp.full(s, temperature, jnp.float32),
        top_k=jnp.full(s, top_k, jnp.int32),
        top_p=jnp.full(s, top_p, jnp.float32),
        min_p=jnp.full(s, min_p, jnp.float32),
        rng_keys=jnp.asarray(keys),
        sample_counters=jnp.asarray(np.zeros(s) if counters is None else counters, jnp.int32),
        flags=jnp.asarray(flags, jnp.int32),
        penalty_args=(
            jnp.zeros((s, 4), jnp.int32),
            jnp.zeros(s, jnp.int32),
            jnp.zeros(s, jnp.int32),
            jnp.zeros(s),
            jnp.zeros(s),
            jnp.ones(s),
        ),
        num_top_logprobs=3,
        num_rows=None if num_rows is None else jnp.int32(num_rows),
    )
    return np.asarray(out.token_ids)


LOGITS = np.log(
    np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.005, 0.003, 0.001, 0.0005, 0.0005])
)


@pytest.mark.parametrize(
    "kwargs, allowed",
    [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.5), {0, 1}),  # 0.4 < 0.5, then 0.65 covers it
        (dict(top_p=0.3), {0}),
        (dict(min_p=0.3), {0, 1, 2}),  # p >= 0.12
        (dict(top_k=3, top_p=0.9), {0, 1, 2}),
    ],
)
def test_filters_keep_exactly_the_allowed_tokens(kwargs, allowed):
    logits = np.tile(LOGITS, (512, 1))
    drawn = set(run(logits, temperature=1.0, **kwargs).tolist())
    assert drawn == allowed


def _allowed(logits, top_k=0, top_p=1.0, min_p=0.0):
    """The filters' kept token ids, by the definition: rank, mass ranked above, min_p."""
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = (before < top_p) & (probs >= min_p * probs[0])
    if top_k > 0:
        keep &= np.arange(len(order)) < top_k
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),  # no filter: the whole vocabulary, unsorted
        dict(top_k=5),  # within the top candidates
        dict(top_p=0.5),  # a peaked row: the top candidates hold the mass
        dict(min_p=0.2),
        dict(top_p=0.95),  # a flat tail: more kept tokens than candidates, the full sort
    ],
)
def test_large_vocabularies_take_each_path_exactly(kwargs):
    """3,000 tokens (more than FILTER_CANDIDATES): every draw is a kept token, and where
    the kept set is larger than the candidates, draws land past them."""
    from jaxcb.sampling import FILTER_CANDIDATES

    rng = np.random.default_rng(0)
    row = rng.standard_normal(3000) * 0.05  # flat
    row[:8] += np.linspace(6, 4, 8)  # a peak of eight
    logits = np.tile(row, (256, 1))
    drawn = run(logits, temperature=1.0, **kwargs)
    allowed = _allowed(row.astype(np.float32), **kwargs)
    assert set(drawn.tolist()) <= allowed
    rank = {t: r for r, t in enumerate(np.argsort(-row.astype(np.float32), kind="stable"))}
    if len(allowed) > FILTER_CANDIDATES:
        assert max(rank[t] for t in drawn.tolist()) >= FILTER_CANDIDATES
    if kwargs == {}:
        assert len(set(drawn.tolist())) > 100  # the tail is drawn too


def test_only_the_real_rows_are_drawn():
    """Past `num_rows` (a bucket's padding) nothing is drawn: token 0; the real rows draw
    exactly what they draw when every row is real (each row has its own key)."""
    logits = np.tile(LOGITS[::-1], (16, 1))  # token 0 least likely: padding stands out
    every = run(logits, temperature=1.0)
    some = run(logits, temperature=1.0, num_rows=5)
    assert some[:5].tolist() == every[:5].tolist() and not some[5:].any()
    assert (every[5:] != 0).any()


def test_greedy_and_temperature():
    logits = np.tile(LOGITS, (64, 1))
    assert set(run(logits, temperature=0.0).tolist()) == {0}
    assert set(run(logits, temperature=0.0, flags=(0, 0, 0, 0)).tolist()) == {0}
    hot = run(np.tile(LOGITS, (2048, 1)), temperature=1.0)
    freq0 = np.mean(hot == 0)
    assert 0.35 < freq0 < 0.45  # p(token 0) = 0.4


def test_same_seed_same_draw_different_counter_different_draw():
    logits = np.tile(np.zeros(V), (4, 1))
    a = run(logits, temperature=1.0, seeds=[7, 7, 7, 7], counters=[0, 0, 1, 2])
    assert a[0] == a[1]
    b = run(np.tile(np.zeros(V), (64, 1)), temperature=1.0, seeds=[7] * 64, counters=np.arange(64))
    assert len(set(b.tolist())) > 3


def test_penalties_match_vllm_semantics():
    logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0]], jnp.float32)
    # history: prompt [0], output [3, 3]
    history = jnp.asarray([[0, 3, 3, 1, 1]], jnp.int32)  # entries past length 3 are stale
    out = apply_penalties(
        logits,
        history,
        jnp.asarray([3]),  # valid history length
        jnp.asarray([1]),  # prompt tokens
        jnp.asarray([0.5]),  # presence
        jnp.asarray([0.25]),  # frequency
        jnp.asarray([2.0]),  # repetition
    )
    expected = [
        2.0 / 2,  # in prompt: repetition only
        -1.0,  # only in stale history: untouched
        0.5,
        3.0 / 2 - 0.25 * 2 - 0.5,  # output twice: repetition, frequency x2, presence
    ]
    np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-6)


def test_argmax_last_axis_matches_argmax_with_ties_and_odd_vocab():
    from jaxcb.sampling import argmax_last_axis

    rng = np.random.default_rng(0)
    for vocab in (7, 128, 300, 32000):
        x = rng.integers(-3, 3, size=(9, vocab)).astype(np.float32)  # many ties
        x[0] = -np.inf
        x[0, vocab // 2] = 5.0
        got = np.asarray(jax.jit(argmax_last_axis)(jnp.asarray(x)))
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
