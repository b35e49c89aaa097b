"""On-device sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each row draws with its own key, `fold_in(key(seed), number of tokens generated so far)`, so a
request's tokens depend only on its seed and its own logits, never on its batch neighbours,
and a preempted request that is recomputed draws the same tokens again.

Work that most batches do not need (filters, penalties, top logprobs) sits behind `lax.cond`
so all-greedy batches pay only for an argmax. Nothing here sorts a vocabulary-sized row: the
filters rank a bounded candidate set, or find their cut by a threshold search (see
`_filtered_sample`), and top logprobs take a top-k that XLA runs as a TopK kernel (the
ranking primitives are top_k.py's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxcb.top_k import largest_k, order_keys, smallest_key_where, top_candidates

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class SamplingOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: log-probability of the chosen token (0 unless requested)
    top_token_ids: jax.Array  # i32[S, K]
    top_logprobs: jax.Array  # f32[S, K]


jax.tree_util.register_dataclass(
    SamplingOutput,
    data_fields=["token_ids", "logprobs", "top_token_ids", "top_logprobs"],
    meta_fields=[],
)


def argmax_last_axis(x: jax.Array) -> jax.Array:  # i32[S]
    """First index of the maximum along the last axis: `argmax_in_blocks` on CPU, XLA's
    argmax elsewhere (where reshaping a vocabulary split over chips into blocks would
    gather it whole first)."""
    return jax.lax.platform_dependent(
        x,
        cpu=argmax_in_blocks,
        default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
    )


def argmax_in_blocks(x: jax.Array, lanes: int = 128) -> jax.Array:  # i32[S]
    """First index of the maximum along the last axis, computed in two passes.

    XLA's CPU backend lowers argmax to a (value, index) pair reduction that does not
    vectorize: 6 ms for [64, 32000]. Taking block maxima first and the argmax of one block
    after costs 0.45 ms and keeps argmax's first-index tie-break.
    """
    rows, vocab = x.shape
    pad = -vocab % lanes
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, -1, lanes)  # [S, V / lanes, lanes]
    best_block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # first block holding the max
    block = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]  # [S, lanes]
    return (best_block * lanes + jnp.argmax(block, axis=-1)).astype(jnp.int32)


def apply_penalties(
    logits: jax.Array,  # f32[S, V]
    token_ids: jax.Array,  # i32[S, M]: each row's distinct tokens so far, ascending, then
    # ids past the vocabulary (dropped), distinct per column (step_input.penalty_arrays)
    output_counts: jax.Array,  # f32[S, M]: how often each came out (0: in the prompt only)
    presence: jax.Array,  # f32[S]
    frequency: jax.Array,  # f32[S]
    repetition: jax.Array,  # f32[S]
) -> jax.Array:
    """vLLM/OpenAI semantics: repetition over prompt + output, presence/frequency over output.

    The (row, token) pairs are unique and sorted, and the scatters say so: XLA on TPU
    sorts a scatter's indices otherwise (2M of them at 256 rows x 8,192 tokens)."""
    num_seqs, vocab = logits.shape
    rows = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], token_ids.shape)
    scatter = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    out_counts = (
        jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, token_ids].set(output_counts, **scatter)
    )
    any_seen = jnp.zeros((num_seqs, vocab), bool).at[rows, token_ids].set(True, **scatter)
    rep = repetition[:, None]
    logits = jnp.where(any_seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * out_counts
    logits = logits - presence[:, None] * (out_counts > 0)
    return logits


#: The candidates a filtered draw ranks: the row's top FILTER_CANDIDATES tokens, when they
#: provably hold every token its filters keep (else a threshold search over the row, below).
#: Sorting the 49,152 logits of SmolLM2 costs ~9 ms on a CPU core; taking the top 1,024 ~0.35 ms.
FILTER_CANDIDATES = 1024


def _threshold_draw(
    x: jax.Array,  # f32[1, V]: scaled logits
    log_norm: jax.Array,  # f32[1, 1]: their logsumexp
    top_k: jax.Array,  # i32[1]
    top_p: jax.Array,  # f32[1]
    min_p: jax.Array,  # f32[1]
    keys: jax.Array,  # key[1]
) -> jax.Array:  # i32[1]
    """A row whose kept set may be larger than the candidates: the filters' cut found by
    one threshold search over the row, then the draw among the kept tokens over the whole
    vocabulary, the unfiltered draw (by token id) masked to the kept set.

    The kept set is the sorted definition's, ties included: ranked by logit (lower id first),
    the first n = min(top_k, tokens with probability >= min_p x the top one's, tokens whose
    mass ranked above is < top_p), at least 1. The cut is the key of the n-th: the smallest
    key t with mass above t < top_p and fewer than min(top_k, min_p's count) tokens above t.
    Of the tokens at the cut, those whose mass ranked above, `above + j x p`, stays < top_p
    are kept, lower ids first; that sum is rounded once here, where a sort adds in rank
    order, so a cut within float32 rounding of top_p may fall one token apart."""
    vocab = x.shape[-1]
    ordered = order_keys(x)
    probs = jnp.exp(x - log_norm)
    top = jnp.exp(jnp.max(x, axis=-1, keepdims=True) - log_norm)  # the most likely token's
    by_min_p = jnp.sum(probs >= min_p[:, None] * top)
    by_top_k = jnp.where((top_k[0] <= 0) | (top_k[0] >= vocab), vocab, top_k[0])
    limit = jnp.maximum(jnp.minimum(by_top_k, by_min_p), 1).astype(jnp.float32)
    weights = jnp.concatenate([probs, jnp.ones_like(probs)])  # [2, V]: mass, count
    cut = smallest_key_where(ordered, weights, jnp.stack([top_p[0], limit]))
    above, at = ordered > cut, ordered == cut
    mass_above = jnp.sum(jnp.where(above, probs, 0.0))
    p_at = jnp.max(jnp.where(at, probs, 0.0))
    by_mass = jnp.where(p_at > 0, jnp.ceil((top_p[0] - mass_above) / p_at), jnp.inf)
    take = jnp.maximum(jnp.minimum(limit - jnp.sum(above), by_mass), 1.0)

    def split_ties() -> jax.Array:  # the cut falls inside a tie group: lower ids first
        return above | (at & (jnp.cumsum(at, axis=-1) <= take))

    # A cumulative count over the row costs as much as the search; ties at the cut are rare.
    keep = jax.lax.cond(jnp.sum(at) > take, split_ties, lambda: above | at)
    return draw_categorical(keys, jnp.where(keep, x, NEG_INF))


DRAW_BLOCK = 128  # tokens per block of draw_categorical's two-level cumulative sum


def draw_categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:  # i32[R]
    """One token per row of [R, V] `logits`, drawn from their softmax (-inf: never), by
    inverse CDF: one uniform per row against the row's cumulative weights, the first token
    whose cumulative weight reaches it. The law of Gumbel-max (`jax.random.categorical`),
    with one random number a row instead of one a token: threefry noise for a whole
    vocabulary was most of a sampled decode step on a CPU (64 rows of 49,152 tokens, 2-core
    Zen 5: 49.5 ms, this draw 6.0 ms). A row's token depends on its key and logits alone.
    The sum runs in blocks of DRAW_BLOCK tokens, then over the blocks, so its rounding stays
    that of a few hundred additions whatever the vocabulary."""
    rows, vocab = logits.shape
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.where(logits == NEG_INF, 0.0, jnp.exp(logits - jnp.where(top > NEG_INF, top, 0)))
    blocks = -(-vocab // DRAW_BLOCK)
    padded = jnp.pad(weights, ((0, 0), (0, blocks * DRAW_BLOCK - vocab)))
    inner = jnp.cumsum(padded.reshape(rows, blocks, DRAW_BLOCK), axis=-1)
    before = jnp.cumsum(inner[:, :, -1], axis=-1) - inner[:, :, -1]  # the blocks ahead's sum
    cum = (inner + before[:, :, None]).reshape(rows, -1)[:, :vocab]
    u = jax.vmap(jax.random.uniform)(keys)  # [0, 1)
    # (0, total]: a token of weight 0 is never the first to reach it
    threshold = (1.0 - u) * cum[:, -1]
    token = jnp.sum(cum < threshold[:, None], axis=-1)
    return jnp.minimum(token, vocab - 1).astype(jnp.int32)


def _unfiltered(top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, vocab: int) -> jax.Array:
    """Rows whose filters keep the whole vocabulary."""
    return ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1.0) & (min_p <= 0.0)


def _draw_whole(scaled: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(each row drawn from its whole distribution, its argmax) of [R, V] scaled logits."""
    return draw_categorical(keys, scaled), jnp.argmax(scaled, axis=-1)


def _filtered_sample(
    logits: jax.Array,  # f32[1, V]
    temperature: jax.Array,  # f32[1]
    top_k: jax.Array,  # i32[1]: 0 disables
    top_p: jax.Array,  # f32[1]
    min_p: jax.Array,  # f32[1]
    keys: jax.Array,  # key[1]
    *,
    candidates: int = FILTER_CANDIDATES,
) -> jax.Array:  # i32[1]
    """A row's token: greedy where temperature is 0, else drawn from the tokens the filters
    keep, ranked by logit (ties: lower id first): rank < top_k, probability mass ranked
    above < top_p, probability >= min_p x the top one's; the top token always.

    Rows without filters draw from the whole vocabulary, by token id (`draw_categorical`).
    Rows whose kept tokens lie provably within the top `candidates` draw among those, by
    rank (as a full sort would); the rest find the cut by `_threshold_draw` and draw by token
    id: the same kept set and distribution, not the same token a full sort's rank-ordered
    draw would pick (which needs every kept token's rank: a sort)."""
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    vocab = logits.shape[-1]
    cands = min(candidates, vocab)
    no_top_k = (top_k <= 0) | (top_k >= vocab)
    unfiltered = _unfiltered(top_k, top_p, min_p, vocab)

    def draw_ranked(
        ranked: jax.Array, ids: jax.Array, log_norm: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Draw from the top-ranked logits `ranked` [1, R] (R <= V, most likely first) of
        token ids `ids`, the filters applied with probabilities over the whole vocabulary
        (`log_norm`: its logsumexp)."""
        probs = jnp.exp(ranked - log_norm)
        rank = jnp.arange(ranked.shape[-1])[None, :]
        keep = no_top_k[:, None] | (rank < top_k[:, None])
        cum_before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above
        keep &= cum_before < top_p[:, None]
        keep &= probs >= min_p[:, None] * probs[:, :1]
        keep = keep.at[:, 0].set(True)  # the most likely token always survives
        choice = draw_categorical(keys, jnp.where(keep, ranked, NEG_INF))
        return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0], ids[:, 0]

    def whole(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _draw_whole(x, keys)

    def filtered(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_norm = jax.nn.logsumexp(x, axis=-1, keepdims=True)
        values, ids = top_candidates(x, cands)  # ties: the lower id first, as a sort
        probs = jnp.exp(values - log_norm)
        # The top `cands` tokens hold every kept one when top_k is at most that many, when
        # their mass reaches top_p (the next token has that much ranked above it), or when
        # the last of them already falls below min_p (every later one does too).
        fits = (
            (~no_top_k & (top_k <= cands))
            | (probs.sum(axis=-1) >= top_p)
            | (probs[:, -1] < min_p * probs[:, 0])
        )

        def search() -> tuple[jax.Array, jax.Array]:
            return _threshold_draw(x, log_norm, top_k, top_p, min_p, keys), ids[:, 0]

        return jax.lax.cond(jnp.all(fits), lambda: draw_ranked(values, ids, log_norm), search)

    sampled, best = jax.lax.cond(jnp.all(unfiltered), whole, filtered, scaled)
    return jnp.where(greedy, best, sampled).astype(jnp.int32)


def draw_all_rows(
    logits: jax.Array,  # f32[S, V]
    temperature: jax.Array,  # f32[S]
    top_k: jax.Array,  # i32[S]
    top_p: jax.Array,  # f32[S]
    min_p: jax.Array,  # f32[S]
    keys: jax.Array,  # key[S]
    real: jax.Array,  # bool[S]: rows to draw (the rest: any token)
) -> jax.Array:  # i32[S]
    """Every row's `_filtered_sample` at once, each row's token the one it would draw
    alone: when no real row has a filter, the unfiltered draw over the batch (what each
    row's own call does then); else the per-row call vmapped (its conds become selects,
    so every row pays for the candidates, the draw among them and the threshold search)."""
    vocab = logits.shape[-1]
    # Padding rows draw unfiltered, so that they never send the batch down the filtered path.
    top_k, top_p, min_p = jnp.where(real, top_k, 0), jnp.where(real, top_p, 1.0), min_p * real
    unfiltered = _unfiltered(top_k, top_p, min_p, vocab)

    def one(x: jax.Array, *row: jax.Array) -> jax.Array:
        return _filtered_sample(x[None], *(a[None] for a in row))[0]

    def plain(x: jax.Array) -> jax.Array:  # `_filtered_sample`'s unfiltered path, batched
        greedy = temperature == 0
        sampled, best = _draw_whole(x / jnp.where(greedy, 1.0, temperature)[:, None], keys)
        return jnp.where(greedy, best, sampled).astype(jnp.int32)

    def filtered(x: jax.Array) -> jax.Array:
        return jax.vmap(one)(x, temperature, top_k, top_p, min_p, keys)

    return jax.lax.cond(jnp.all(unfiltered), plain, filtered, logits)


def apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """-inf at the ids a row's packed mask forbids (i32[S, W]: id 32 w + i = bit i of word w)."""
    shifts = jnp.arange(32, dtype=jnp.int32)[None, None, :]  # unpacked by broadcasting: no gather
    bits = jax.lax.shift_right_logical(token_mask[:, :, None], shifts) & 1  # [S, W, 32]
    rows, vocab = logits.shape
    allowed = bits.reshape(rows, -1)[:, :vocab] == 1
    return jnp.where(allowed, logits, -jnp.inf)


def sample(
    logits: jax.Array,  # f32[S, V]
    *,
    temperature: jax.Array,  # f32[S]
    top_k: jax.Array,  # i32[S]
    top_p: jax.Array,  # f32[S]
    min_p: jax.Array,  # f32[S]
    rng_keys: jax.Array,  # u32[S, 2] raw threefry key data per request
    sample_counters: jax.Array,  # i32[S] tokens already generated per request
    flags: jax.Array,  # i32[4]: any random row / penalties / logprobs / top logprobs
    penalty_args: tuple[jax.Array, ...],  # apply_penalties' arguments after logits
    num_top_logprobs: int,
    greedy_ids: jax.Array | None = None,  # i32[S]: the logits' argmax, if already known
    num_rows: jax.Array | None = None,  # i32: the real rows (the rest a bucket's padding)
    rows_at_once: bool | None = None,
    token_mask: jax.Array | None = None,  # i32[S, ceil(V / 32)]: allowed ids, packed
    any_mask: jax.Array | None = None,  # bool: token_mask applies (some row is constrained)
) -> SamplingOutput:
    """Each row's token (greedy, or drawn under its filters with its own key), and the
    logprobs asked for; padding rows (from `num_rows`, default none) get token 0.

    Random draws (`rows_at_once`, default by platform): on CPU one row at a time, and only
    the first `num_rows` rows, so a bucket's padding rows cost nothing (a single stream in
    a 16-row bucket would otherwise rank 16 rows of the vocabulary per token); on GPU and
    TPU every row at once (`draw_all_rows`), where a loop of 256 rows, each a threshold
    search of ~32 passes, runs thousands of small kernels one after another, and with the
    logits split by vocabulary over chips, an all-reduce inside each. Same tokens."""
    any_random, any_penalty = flags[0] > 0, flags[1] > 0
    any_logprobs, any_top = flags[2] > 0, flags[3] > 0
    raw_logits = logits

    num_seqs = logits.shape[0]
    rows = num_seqs if num_rows is None else jnp.clip(num_rows, 0, num_seqs)

    def draw_rows_at_once(x: jax.Array) -> jax.Array:
        real = jnp.arange(num_seqs) < rows
        data = jax.random.wrap_key_data(rng_keys)
        keys = jax.vmap(jax.random.fold_in)(data, sample_counters)
        tokens = draw_all_rows(x, temperature, top_k, top_p, min_p, keys, real)
        return jnp.where(real, tokens, 0)

    def draw_row_by_row(x: jax.Array) -> jax.Array:
        def one(i: jax.Array, out: jax.Array) -> jax.Array:
            def row(a: jax.Array) -> jax.Array:
                return jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0)

            data, counter = row(rng_keys)[0], row(sample_counters)[0]
            key = jax.random.fold_in(jax.random.wrap_key_data(data), counter)
            token = _filtered_sample(
                row(x), row(temperature), row(top_k), row(top_p), row(min_p), key[None]
            )
            return jax.lax.dynamic_update_slice_in_dim(out, token, i, axis=0)

        return jax.lax.fori_loop(0, rows, one, jnp.zeros(num_seqs, jnp.int32))

    if rows_at_once is None:  # a loop over rows on CPU; all rows at once on accelerators
        draw = functools.partial(
            jax.lax.platform_dependent, cpu=draw_row_by_row, default=draw_rows_at_once
        )
    else:
        draw = draw_rows_at_once if rows_at_once else draw_row_by_row

    masked = jnp.bool_(False) if token_mask is None else any_mask

    def general(x: jax.Array) -> jax.Array:
        if token_mask is not None:  # structured outputs: before penalties and the filters
            x = jax.lax.cond(masked, lambda y: apply_token_mask(y, token_mask), lambda y: y, x)
        x = jax.lax.cond(any_penalty, lambda y: apply_penalties(y, *penalty_args), lambda y: y, x)
        return jax.lax.cond(any_random, draw, argmax_last_axis, x)

    # All-greedy batches without penalties take the argmax of the logits as they are: a cond
    # whose untaken branch returns its [S, V] operand unchanged still copies it (16 MB at
    # S=128), so the penalty cond sits inside the general branch only.
    # (The LM head's native CPU kernels take the argmax from their accumulators: no pass over
    # the [S, V] logits at all then.) Under a mask: the mask and the argmax in one fused pass.
    plain_greedy = argmax_last_axis if greedy_ids is None else (lambda x: greedy_ids)

    def greedy(x: jax.Array) -> jax.Array:
        if token_mask is None:
            return plain_greedy(x)
        masked_argmax = lambda y: argmax_last_axis(apply_token_mask(y, token_mask))
        return jax.lax.cond(masked, masked_argmax, plain_greedy, x)

    token_ids = jax.lax.cond(any_random | any_penalty, general, greedy, logits)

    k = num_top_logprobs

    def with_logprobs(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        logprobs = jax.nn.log_softmax(x, axis=-1)  # the model's raw distribution
        chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]

        def top(lp: jax.Array) -> tuple[jax.Array, jax.Array]:
            values, ids = largest_k(lp, k)
            return ids.astype(jnp.int32), values

        top_ids, top_values = jax.lax.cond(any_top, top, no_top, logprobs)
        return chosen, top_ids, top_values

    def no_top(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((num_seqs, k), jnp.int32), jnp.zeros((num_seqs, k), jnp.float32)

    def without_logprobs(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros(num_seqs, jnp.float32), *no_top(x))

    chosen, top_ids, top_values = jax.lax.cond(
        any_logprobs, with_logprobs, without_logprobs, raw_logits
    )
    return SamplingOutput(token_ids, chosen, top_ids, top_values)
