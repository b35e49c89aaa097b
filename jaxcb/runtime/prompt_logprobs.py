"""Prompt logprobs on device: the LM head over the rows that score a prompt token.

The family's forward returns the final normed hidden states of every token row; the rows the
host asked for (StepInput.prompt_logprob_rows, gathered to the front) go through the LM head
(`packed.matmul`, so packed native weights and tied embeddings work as for sampling) in
blocks of BLOCK_ROWS rows: logits, log-softmax, the target's logprob and the top-k. Blocks
keep the memory at [BLOCK_ROWS, V] float32 (25 MB for a 49k vocabulary) instead of [T, V]
(200 MB for a 1024-token bucket), and a loop over only as many blocks as there are rows
makes the cost proportional to what was asked for. The whole computation sits behind one
`lax.cond` on the number of rows: a step without prompt logprobs pays for zero-filled
outputs only.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxcb.models.base import Params
from jaxcb.models.layers import soft_cap
from jaxcb.models.packed import lm_head_weight, matmul
from jaxcb.runtime.step_input import FLAG_PROMPT_TOP_LOGPROBS, StepInput
from jaxcb.top_k import largest_k

BLOCK_ROWS = 128  # rows of logits at a time


@dataclass(frozen=True)
class PromptLogprobsOutput:
    """Per prompt logprob row (the first `num_prompt_logprob_rows` of T; zeros after)."""

    logprobs: jax.Array  # f32[T]: the target token's logprob
    top_token_ids: jax.Array  # i32[T, K]: when flagged, else zeros
    top_logprobs: jax.Array  # f32[T, K]

    @classmethod
    def zeros(cls, num_rows: int, k: int) -> PromptLogprobsOutput:
        return cls(
            jnp.zeros(num_rows, jnp.float32),
            jnp.zeros((num_rows, k), jnp.int32),
            jnp.zeros((num_rows, k), jnp.float32),
        )


jax.tree_util.register_dataclass(
    PromptLogprobsOutput,
    data_fields=["logprobs", "top_token_ids", "top_logprobs"],
    meta_fields=[],
)


def prompt_logprobs(
    params: Params,
    hidden: jax.Array,  # f32[T, H]: every token row's final normed hidden state
    inp: StepInput,
    *,
    num_top_logprobs: int,
    logits_shardings: tuple[jax.sharding.Sharding, ...] = (),
    logit_soft_cap: float | None = None,
) -> PromptLogprobsOutput:
    """The logprobs of the step's prompt logprob targets (and the top-k, if flagged) at their
    rows; zeros unless the step has such rows. `logits_shardings` as for sampling (step.py);
    `logit_soft_cap`: the model's final soft cap (ModelSpec.final_logit_soft_cap)."""
    num_tokens, k = hidden.shape[0], num_top_logprobs
    block = min(num_tokens, BLOCK_ROWS)
    padded = -(-num_tokens // block) * block
    rows, targets = inp.prompt_logprob_rows, inp.prompt_logprob_targets  # i32[T] each
    n = inp.num_prompt_logprob_rows[0]
    want_top = inp.flags[FLAG_PROMPT_TOP_LOGPROBS] > 0

    def nothing(hidden: jax.Array) -> PromptLogprobsOutput:
        return PromptLogprobsOutput.zeros(num_tokens, k)

    def compute(hidden: jax.Array) -> PromptLogprobsOutput:
        h = jnp.pad(hidden[rows], ((0, padded - num_tokens), (0, 0)))  # [P, H], P = padded
        tg = jnp.pad(targets, (0, padded - num_tokens))  # [P]
        weight = lm_head_weight(params)

        def one_block(i: jax.Array, out: PromptLogprobsOutput) -> PromptLogprobsOutput:
            start = i * block
            x = jax.lax.dynamic_slice_in_dim(h, start, block)  # [B, H]
            logits = matmul(x, weight, jnp.clip(n - start, 0, block))  # [B, V]
            for sharding in logits_shardings:
                logits = jax.lax.with_sharding_constraint(logits, sharding)
            if logit_soft_cap is not None:
                logits = soft_cap(logits, logit_soft_cap)
            lse = jax.nn.logsumexp(logits, axis=-1)  # [B]
            target = jax.lax.dynamic_slice_in_dim(tg, start, block)
            chosen = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0] - lse

            def top(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
                values, ids = largest_k(logits, k)  # [B, K]: no whole-row sort on GPUs
                return ids.astype(jnp.int32), values - lse[:, None]

            def no_top(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
                zeros = PromptLogprobsOutput.zeros(block, k)
                return zeros.top_token_ids, zeros.top_logprobs

            if k == 0:  # the engine computes no top logprobs at all
                top_ids, top_values = no_top(logits)
            else:
                top_ids, top_values = jax.lax.cond(want_top, top, no_top, logits)
            put = jax.lax.dynamic_update_slice_in_dim
            return PromptLogprobsOutput(
                put(out.logprobs, chosen, start, 0),
                put(out.top_token_ids, top_ids, start, 0),
                put(out.top_logprobs, top_values, start, 0),
            )

        empty = PromptLogprobsOutput.zeros(padded, k)
        out = jax.lax.fori_loop(0, -(-n // block), one_block, empty)  # only the blocks used
        return jax.tree_util.tree_map(lambda x: x[:num_tokens], out)

    return jax.lax.cond(n > 0, compute, nothing, hidden)
