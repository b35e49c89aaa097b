"""The k largest values of a row, and the ranking behind them, without sorting the row.

Sampling's filters (sampling.py) and the top logprobs (sampling.py, runtime/prompt_logprobs.py)
need a row's largest values over a vocabulary of 32k-256k entries. A whole-row sort costs ~9 ms
per 49,152-entry row on a CPU core, and XLA's GPU backend compiles `lax.top_k` of a large k as
one; these take the k largest by XLA's TopK where it is a kernel, by rounds of small top-k on
GPUs, or by a bisection over the row's order keys (`smallest_key_where`), which also finds the
cut of a top-p or min-p filter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf

#: The largest k that XLA's GPU backend runs as its TopK kernel: for a larger k it sorts the
#: whole row (so compiled H100 programs show), hence `largest_k` and `top_candidates`. On
#: TPU, XLA's top-1,024 of a row is a TopK op for 49,152 or 128,256 tokens but a sort of the
#: row for 32,000 or 151,936 (libtpu 0.0.42); top-20 is a TopK op at every size tried.
GPU_TOP_K = 16


def order_keys(x: jax.Array) -> jax.Array:  # i32, x's shape
    """Integers ordered as `lax.sort` and `lax.top_k` order floats (total order, -0.0 below
    +0.0): a negative float's sign-magnitude bits turned into two's-complement order."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def smallest_key_where(
    keys: jax.Array,  # i32[1, V]: a row's order keys
    weights: jax.Array,  # f32[W, V]
    bounds: jax.Array,  # f32[W]
) -> jax.Array:  # i32: one of the row's keys
    """The smallest key t of the row at which the weight above it stays under every bound
    (sum of weights[w] where keys > t, < bounds[w]; each bound > 0): a bisection over the
    integers, at most 32 masked sums over the row and no sort. The sums only grow as t
    falls and change only at the row's keys, so the answer is one of them."""

    def fits(t: jax.Array) -> jax.Array:
        return jnp.all(jnp.sum(jnp.where(keys > t, weights, 0.0), axis=-1) < bounds)

    def halve(bracket: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bracket  # the answer lies in [lo, hi]; hi fits
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
        ok = fits(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    bracket = (keys.min(), keys.max())
    return jax.lax.while_loop(lambda b: b[0] < b[1], halve, bracket)[1]


def top_k_by_threshold(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` of one row x f32[1, V] (V >= k) without sorting it: the k-th largest
    key by `smallest_key_where`, the k tokens at or above it gathered (ties at it: lower ids
    first, as top_k), and only those k sorted."""
    keys = order_keys(x)
    cut = smallest_key_where(keys, jnp.ones_like(x), jnp.full(1, k, jnp.float32))
    above, at = keys > cut, keys == cut
    taken = above | (at & (jnp.cumsum(at, axis=-1) <= k - jnp.sum(above)))  # k tokens
    # Their ids, ascending: the j-th is where the running count of taken tokens reaches j + 1,
    # found by a binary search (16 gathers of k for 37,984 tokens). jnp.nonzero's scatter
    # gives the same ids, but libtpu took 8 of the 11 s compiling this for 256 rows.
    count = jnp.cumsum(taken[0], dtype=jnp.int32)  # [V]
    nth = jnp.arange(1, k + 1, dtype=jnp.int32)
    ids = jnp.searchsorted(count, nth, side="left", method="scan").astype(jnp.int32)
    _, ids = jax.lax.sort((~keys[0, ids], ids), num_keys=2)  # largest first, then lower id
    return x[:, ids], ids[None]


def top_candidates(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` of one row: XLA's TopK on CPU (0.35 ms for 1,024 of 49,152 tokens,
    where the threshold search takes ~1 ms), the threshold search on accelerators, where XLA
    may sort the row instead (GPU_TOP_K)."""
    return jax.lax.platform_dependent(
        x, cpu=lambda x: tuple(jax.lax.top_k(x, k)), default=lambda x: top_k_by_threshold(x, k)
    )


def top_k_in_rounds(
    x: jax.Array, k: int, per_round: int = GPU_TOP_K
) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis of [S, V] as rounds of top `per_round`, each
    masking the tokens taken: the same answer wherever a row has k finite values."""
    rows = jnp.arange(x.shape[0])[:, None]
    values, ids = [], []
    for _ in range(-(-k // per_round)):
        v, i = jax.lax.top_k(x, per_round)
        values.append(v)
        ids.append(i)
        x = x.at[rows, i].set(NEG_INF)
    return jnp.concatenate(values, -1)[:, :k], jnp.concatenate(ids, -1)[:, :k]


#: Rows of a TPU top-k op (`top_k_in_row_blocks`). libtpu 0.0.42 spends ~4.5 s compiling one
#: lax.top_k of k = 20 over [64, 151,936] or [256, 37,984] float32, 0.4 s over [16, 151,936];
#: 16-row blocks in a loop compile in 0.1-1.5 s at every size tried (S up to 2,048).
TPU_TOP_K_ROWS = 16


def top_k_in_row_blocks(
    x: jax.Array, k: int, rows: int = TPU_TOP_K_ROWS
) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis of [S, V], `rows` rows at a time in a loop (the
    rows padded to a multiple of it): the same answer, each row ranked alone."""
    num_rows, vocab = x.shape
    if num_rows <= rows:
        return tuple(jax.lax.top_k(x, k))
    padded = -(-num_rows // rows) * rows
    blocks = jnp.pad(x, ((0, padded - num_rows), (0, 0))).reshape(-1, rows, vocab)
    values, ids = jax.lax.map(lambda block: jax.lax.top_k(block, k), blocks)
    return values.reshape(padded, k)[:num_rows], ids.reshape(padded, k)[:num_rows]


def largest_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis of [S, V] (top logprobs): on TPU in blocks of
    rows (`top_k_in_row_blocks`, for libtpu's compile time); on GPUs, for k over
    GPU_TOP_K, `top_k_in_rounds` instead of the whole-row sort XLA would compile."""
    whole = lambda x: tuple(jax.lax.top_k(x, k))
    by_rows = lambda x: top_k_in_row_blocks(x, k)
    if k <= GPU_TOP_K:
        return jax.lax.platform_dependent(x, tpu=by_rows, default=whole)
    return jax.lax.platform_dependent(
        x, cuda=lambda x: top_k_in_rounds(x, k), tpu=by_rows, default=whole
    )
