"""A mixture of experts' feed-forward on the device, in static shapes and without a loop over
the experts: each token through the k experts routed to it (moe.py's `route` picks them and
their weights), each a SwiGLU MLP, the k outputs summed by those weights.

The T x k (token, expert) assignments are sorted by expert (stable), the tokens' rows
gathered in that order, and each expert's contiguous run goes through its weights in one
grouped matmul (packed.grouped_swiglu, packed.grouped_matmul: ragged_dot, or a native kernel
behind them) with the per-expert counts as group sizes. No capacity limit, so no token is
ever dropped, and a bucket's padding rows are sorted last and left out of the group sizes:
they cost nothing and come out zero.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcb.models.packed import grouped_matmul, grouped_swiglu


def sort_by_expert(
    experts: jax.Array, num_experts: int, real_tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The order that groups the flattened (token, slot) assignments (i32[T, k] experts,
    row t * k + j) by expert, i32[T * k], and each expert's count, i32[E]. The assignments
    of padding tokens (rows >= real_tokens) sort after every real one and are in no group,
    so the grouped matmuls skip them."""
    num_tokens, k = experts.shape
    token = jnp.arange(num_tokens * k) // k
    key = jnp.where(token < real_tokens, experts.reshape(-1), num_experts)  # E: padding
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts]
    return order, group_sizes.astype(jnp.int32)


def experts_ffn(
    h: jax.Array,  # f32[T, H]
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k]
    w_gate_up: Any,  # [E, H, 2, I] (or packed for a native kernel)
    w_down: Any,  # [E, I, H]
    num_experts: int,
    real_tokens: jax.Array,
) -> jax.Array:
    """sum over j of weights[t, j] * expert_{experts[t, j]}(h[t]): f32[T, H], zero on
    padding rows. One grouped SwiGLU and one grouped down projection over the T * k rows
    sorted by expert; then each row back to its (token, slot) and the k slots summed in
    slot order, as transformers' grouped path sums them."""
    num_tokens, k = experts.shape
    order, group_sizes = sort_by_expert(experts, num_experts, real_tokens)
    rows = h[order // k]  # [T * k, H]: each assignment's token, grouped by expert
    act = grouped_swiglu(rows, w_gate_up, group_sizes)  # [T * k, I]
    out = grouped_matmul(act, w_down, group_sizes)  # [T * k, H]
    out = out * weights.reshape(-1)[order][:, None]
    # the inverse permutation: a gather back to (token, slot) order
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_slot = out[inverse].reshape(num_tokens, k, -1)  # [T, k, H]
    total = per_slot[:, 0]
    for j in range(1, k):  # a fixed order of the k additions
        total = total + per_slot[:, j]
    return total
