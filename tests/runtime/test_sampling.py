"""On-device sampling: filters keep exactly the allowed tokens, penalties follow vLLM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.sampling import DRAW_BLOCK, apply_penalties, draw_categorical, sample

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
    rows_at_once=None,
):
    s = logits.shape[0]
    seeds = np.arange(s) if seeds is None else np.asarray(seeds)
    keys = np.stack([np.zeros_like(seeds), seeds], axis=1).astype(np.uint32)
    out = jax.jit(sample, static_argnames=("num_top_logprobs", "rows_at_once"))(
        jnp.asarray(logits, jnp.float32),
        temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (s,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (s,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (s,)),
        min_p=jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), (s,)),
        rng_keys=jnp.asarray(keys),
        sample_counters=jnp.asarray(np.zeros(s) if counters is None else counters, jnp.int32),
        flags=jnp.asarray(flags, jnp.int32),
        penalty_args=(
            jnp.full((s, 4), 1 << 30, jnp.int32) + jnp.arange(4, dtype=jnp.int32),
            jnp.zeros((s, 4)),
            jnp.zeros(s),
            jnp.zeros(s),
            jnp.ones(s),
        ),
        num_top_logprobs=3,
        num_rows=None if num_rows is None else jnp.int32(num_rows),
        rows_at_once=rows_at_once,
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
        dict(top_p=0.95),  # a flat tail: more kept tokens than candidates, the search
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
    from jaxcb.runtime.step_input import penalty_arrays

    logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]], jnp.float32)
    # row 0: prompt [0], output [3, 3]; row 1: padding
    ids, counts = penalty_arrays([[0, 3, 3]], [1], num_rows=2, max_model_len=5)
    np.testing.assert_array_equal(ids[0, :2], [0, 3])
    np.testing.assert_array_equal(counts[0], [0, 2, 0, 0, 0])
    assert len(set(ids[1])) == 5 and ids[1].min() >= 4  # distinct, past the vocabulary
    out = apply_penalties(
        logits,
        jnp.asarray(ids),
        jnp.asarray(counts),
        jnp.asarray([0.5, 0.5]),  # presence
        jnp.asarray([0.25, 0.25]),  # frequency
        jnp.asarray([2.0, 2.0]),  # repetition
    )
    expected = [
        2.0 / 2,  # in prompt: repetition only
        -1.0,  # not seen: untouched
        0.5,
        3.0 / 2 - 0.25 * 2 - 0.5,  # output twice: repetition, frequency x2, presence
    ]
    np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[1], [1.0] * 4)


def test_argmax_last_axis_matches_argmax_with_ties_and_odd_vocab():
    from jaxcb.sampling import argmax_last_axis

    rng = np.random.default_rng(0)
    for vocab in (7, 128, 300, 32000):
        x = rng.integers(-3, 3, size=(9, vocab)).astype(np.float32)  # many ties
        x[0] = -np.inf
        x[0, vocab // 2] = 5.0
        got = np.asarray(jax.jit(argmax_last_axis)(jnp.asarray(x)))
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


# --- Issue 18: no full-vocabulary sort. A plain full-sort reference, and the draws' law. ---


def _key(seed: int, counter: int) -> jax.Array:
    return jax.random.fold_in(jax.random.wrap_key_data(np.array([0, seed], np.uint32)), counter)


def reference_token(row, temperature, top_k, top_p, min_p, seed, counter, candidates):
    """One row's token by the full-sort definition, in float64 (asserting that no kept-set
    or path decision lies within float32 rounding of its bound). The kept set: the row
    sorted by logit (ties: lower id first), rank < top_k, mass ranked above < top_p,
    probability >= min_p x the top one's, the top token always. The draw (sampling's
    draw_categorical): by rank among the top `candidates` where they provably hold the kept
    set (as the code before issue 18 drew), else by token id over the vocabulary (its full
    sort drew by rank)."""
    vocab, tol = row.shape[0], 2e-6
    if temperature == 0:
        return int(np.argmax(row)), "greedy"
    x = np.asarray(jnp.asarray(row, jnp.float32) / jnp.float32(temperature))
    key = _key(seed, counter)[None]
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1 and min_p <= 0:
        return int(draw_categorical(key, jnp.asarray(x)[None])[0]), "whole"
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x[order].astype(np.float64) - x.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = (before < top_p) & (probs >= min_p * probs[0])
    if 0 < top_k < vocab:
        keep &= np.arange(vocab) < top_k
    keep[0] = True
    c = min(candidates, vocab)
    if top_p < 1:  # no cut within rounding of top_p
        assert np.abs(before - top_p).min() > tol and abs(probs[:c].sum() - top_p) > tol
    if min_p > 0:
        assert np.abs(probs / probs[0] - min_p).min() > tol
    fits = 0 < top_k <= c or probs[:c].sum() >= top_p or probs[c - 1] < min_p * probs[0]
    if fits:
        ranked = jnp.where(jnp.asarray(keep[:c]), jnp.asarray(x[order[:c]]), -jnp.inf)
        return int(order[int(draw_categorical(key, ranked[None])[0])]), "ranked"
    kept = np.zeros(vocab, bool)
    kept[order[keep]] = True
    masked = jnp.where(jnp.asarray(kept), jnp.asarray(x), -jnp.inf)
    return int(draw_categorical(key, masked[None])[0]), "threshold"


def mixed_rows(vocab=4096, seed=0):
    """Rows and filters that take every path: peaked rows (the candidates hold the kept set),
    flat rows (kept sets of thousands), and three-level rows whose cuts fall inside groups
    of ~1,365 tied tokens (ties: lower ids first)."""
    rng = np.random.default_rng(seed)
    kinds = {
        "peaked": lambda: rng.standard_normal(vocab) * 3.0,
        "flat": lambda: rng.standard_normal(vocab) * 0.3,
        "ties": lambda: rng.integers(0, 3, vocab) * 0.25,
    }
    cases = [  # kind, temperature, top_k, top_p, min_p
        ("peaked", 1.0, 0, 0.9, 0.0),
        ("peaked", 0.7, 50, 0.9, 0.0),
        ("peaked", 1.3, 0, 1.0, 0.05),
        ("peaked", 0.0, 50, 0.9, 0.0),
        ("peaked", 1.0, 0, 1.0, 0.0),
        ("flat", 1.0, 0, 0.9, 0.0),
        ("flat", 0.8, 2000, 1.0, 0.0),
        ("flat", 1.0, 50, 0.9, 0.0),
        ("flat", 1.0, 0, 0.8, 0.2),
        ("flat", 1.2, 3000, 0.95, 0.1),
        ("flat", 1.0, 0, 1.0, 0.0),
        ("ties", 1.0, 0, 0.35, 0.0),
        ("ties", 1.0, 1500, 1.0, 0.0),
        ("ties", 1.0, 700, 1.0, 0.0),
        ("ties", 1.0, 0, 1.0, 0.7),
        ("ties", 1.0, 0, 0.3, 0.0),
    ]
    rows, params = [], []
    for kind, *p in cases * 3:
        rows.append(kinds[kind]().astype(np.float32))
        params.append(p)
    return np.stack(rows), np.array(params, np.float64)


@pytest.mark.parametrize("rows_at_once", [False, True], ids=["row-by-row", "rows-at-once"])
def test_same_tokens_as_a_full_sort_on_seeded_requests(rows_at_once):
    """Every path's token equals the plain full-sort reference's on seeded requests: 48 rows
    of 4,096 tokens (more than FILTER_CANDIDATES), both the candidate and the threshold path
    taken, cuts inside tie groups included; drawn row by row (CPU) and all rows at once
    (GPU/TPU)."""
    from jaxcb.sampling import FILTER_CANDIDATES

    logits, params = mixed_rows()
    temperature, top_k, top_p, min_p = params.T
    seeds, counters = np.arange(len(logits)) * 7 + 3, np.arange(len(logits)) % 5
    got = run(
        logits,
        temperature=temperature,
        top_k=top_k.astype(np.int32),
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        counters=counters,
        rows_at_once=rows_at_once,
    )
    want, paths = zip(
        *(
            reference_token(row, t, int(k), p, m, int(s), int(c), FILTER_CANDIDATES)
            for row, (t, k, p, m), s, c in zip(logits, params, seeds, counters, strict=True)
        ),
        strict=True,
    )
    assert got.tolist() == list(want)
    taken = {p: paths.count(p) for p in set(paths)}
    assert taken == {"greedy": 3, "whole": 6, "ranked": 18, "threshold": 21}


def test_rows_at_once_draws_each_row_as_alone_and_skips_padding():
    """All rows at once: unfiltered batches (padding rows with filters must not divert them)
    and mixed batches give each real row the token it draws row by row; padding rows get 0."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((8, 300)).astype(np.float32) * 2
    temperature = np.array([1.0, 0.0, 0.7, 1.0, 1.3, 1.0, 0.0, 1.0])
    for top_p in (np.ones(8), np.array([1.0, 1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.2])):
        common = dict(temperature=temperature, top_p=top_p, seeds=np.arange(8) + 11)
        top_p_padding = np.where(np.arange(8) < 5, top_p, 0.1)  # padding rows filtered
        loop = run(logits, num_rows=5, rows_at_once=False, **common)
        common["top_p"] = top_p_padding
        batch = run(logits, num_rows=5, rows_at_once=True, **common)
        assert batch.tolist() == loop.tolist()
        assert batch[5:].tolist() == [0, 0, 0]


def draw_filtered(logits, *, candidates, seeds, top_k=0, top_p=1.0, min_p=0.0):
    """Each row drawn by `_filtered_sample` with `candidates` top candidates (2: the
    threshold search on any row whose kept set holds more than 2 tokens)."""
    from jaxcb.sampling import _filtered_sample

    filters = [jnp.full(1, v, t) for v, t in ((top_k, jnp.int32), (top_p, "f4"), (min_p, "f4"))]

    def one(row, seed):
        key = jax.random.fold_in(jax.random.wrap_key_data(jnp.stack([0, seed]).astype("u4")), 0)
        return _filtered_sample(row[None], jnp.ones(1), *filters, key[None], candidates=candidates)

    return np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(logits), jnp.asarray(seeds))[:, 0])


@pytest.mark.parametrize(
    "row, kwargs",
    [
        (np.zeros(V), dict(top_p=0.3)),  # all tied: ids 0..3 (3/12 < 0.3 <= 4/12)
        (np.zeros(V), dict(top_k=5)),
        (LOGITS, dict(top_k=3)),
        (LOGITS, dict(min_p=0.3)),
        (np.repeat([1.0, 0.0, -1.0], 4), dict(top_p=0.7)),  # cut in the middle ties: ids 0..4
    ],
)
def test_threshold_search_keeps_exactly_the_sorted_kept_set(row, kwargs):
    """2,000 draws through the threshold search (2 candidates) land on exactly the kept set
    of the sorted definition, ties at the cut split by id."""
    tokens = draw_filtered(np.tile(row, (2000, 1)), candidates=2, seeds=np.arange(2000), **kwargs)
    assert set(tokens.tolist()) == _allowed(row.astype(np.float32), **kwargs)


@pytest.mark.parametrize("candidates", [1024, 2], ids=["candidates", "threshold-search"])
def test_top_p_draws_follow_the_renormalized_nucleus(candidates):
    """4,000 seeded draws under top_p 0.85 from p = (0.4, 0.25, 0.15, 0.1, 0.05, ...): only the
    nucleus {0, 1, 2, 3} (mass ranked above < 0.85), in proportion 0.4 : 0.25 : 0.15 : 0.1.
    Chi-square bound 16.27 (p = 0.001 at 3 degrees of freedom; fixed seeds, deterministic).
    A filter cutting by inclusive mass drops token 3 (chi-square ~ 500), one drawing the
    nucleus uniformly ~ 1,000."""
    draws = 4000
    tokens = draw_filtered(
        np.tile(LOGITS, (draws, 1)), top_p=0.85, candidates=candidates, seeds=np.arange(draws)
    )
    counts = np.bincount(tokens, minlength=V)
    assert counts[4:].sum() == 0
    expected = draws * np.exp(LOGITS[:4]) / np.exp(LOGITS[:4]).sum()
    chi2 = ((counts[:4] - expected) ** 2 / expected).sum()
    assert chi2 < 16.27, (counts[:4], expected)


def tie_heavy_rows(vocab=3000):
    rng = np.random.default_rng(1)
    rows = rng.integers(-2, 3, size=(6, vocab)).astype(np.float32)  # five values, many ties
    rows[1, ::2] = -0.0  # -0.0 ranks below +0.0 in lax.top_k's total order
    rows[1, 1::2] = 0.0
    rows[2, 100:] = -np.inf  # fewer finite values than candidates
    rows[3] = rng.standard_normal(vocab)
    rows[4, :] = 1.0  # all tied
    return rows


def test_accelerator_top_k_variants_match_lax_top_k():
    """The GPU-side substitutes for XLA's whole-row sort, and the TPU's top-k in blocks of
    rows, give lax.top_k's answer exactly, ties (lower id first), signed zeros and -inf
    included."""
    from jaxcb.top_k import top_k_by_threshold, top_k_in_rounds, top_k_in_row_blocks

    rows = jnp.asarray(tie_heavy_rows())
    by_threshold = jax.jit(top_k_by_threshold, static_argnames="k")
    for row in rows:
        for k in (1, 7, 1024):
            got_v, got_i = by_threshold(row[None], k=k)
            want_v, want_i = jax.lax.top_k(row[None], k)
            np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
            np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    for rows_per_block in (1, 4, 16):  # (the TPU form: blocks of rows, the last padded)
        got_v, got_i = top_k_in_row_blocks(rows, 20, rows_per_block)
        want_v, want_i = jax.lax.top_k(rows, 20)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    finite = rows[jnp.asarray([0, 1, 3, 4, 5])]  # k finite values per row
    got_v, got_i = jax.jit(top_k_in_rounds, static_argnames="k")(finite, k=20)
    want_v, want_i = jax.lax.top_k(finite, 20)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_draw_categorical_draws_from_the_softmax():
    """Inverse-CDF draws: the softmax's law (chi-square over 20,000 keys), never a -inf
    token, each row's token its own whatever the batch, and a vocabulary past one block."""
    from scipy.stats import chisquare

    logits = np.array([2.0, -np.inf, 0.5, 1.0, -1.0, -np.inf, 0.0, 3.0], np.float32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(20_000))
    rows = jnp.broadcast_to(jnp.asarray(logits), (20_000, 8))
    tokens = np.asarray(draw_categorical(keys, rows))
    counts = np.bincount(tokens, minlength=8)
    assert counts[1] == counts[5] == 0
    p = np.exp(logits.astype(np.float64) - logits.max())
    live = p > 0
    expected = 20_000 * p[live] / p[live].sum()
    assert chisquare(counts[live], expected * counts.sum() / expected.sum()).pvalue > 1e-3
    wide = jnp.asarray(np.random.default_rng(3).standard_normal((5, 3 * DRAW_BLOCK + 17)) * 4)
    five = jax.vmap(lambda i: jax.random.key(i))(jnp.arange(5))
    batched = np.asarray(draw_categorical(five, wide.astype(jnp.float32)))
    for r in range(5):
        alone = draw_categorical(five[r : r + 1], wide[r : r + 1].astype(jnp.float32))
        assert int(alone[0]) == batched[r]
    spike = np.full((1, 3 * DRAW_BLOCK + 17), -np.inf, np.float32)
    spike[0, 2 * DRAW_BLOCK + 5] = 0.0  # one possible token, in a later block
    assert int(draw_categorical(five[:1], jnp.asarray(spike))[0]) == 2 * DRAW_BLOCK + 5
