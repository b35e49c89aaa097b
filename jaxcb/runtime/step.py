"""THE step function: model forward over a packed ragged batch, KV write, sampling, and
the prompt logprobs of the rows that ask for them (runtime/prompt_logprobs.py).

The forward is that of the spec's family (models/registry.py). One function serves every
bucket (each bucket is compiled once, ahead of time). The runner jits it with its mesh's
shardings (runner.py) and `spec`, `attention`, `num_top_logprobs` static; the device state
(the KV pages) is donated, so XLA updates it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcb.models import registry
from jaxcb.models.base import AttentionBackend, AttentionMetadata, ModelSpec, Params
from jaxcb.runtime.kv_cache import DeviceState
from jaxcb.runtime.prompt_logprobs import PromptLogprobsOutput, prompt_logprobs
from jaxcb.runtime.step_input import (
    FLAG_LOGPROBS,
    FLAG_MASK,
    FLAG_PENALTY,
    FLAG_RANDOM,
    StepInput,
)
from jaxcb.sampling import SamplingOutput, sample

#: Incremented each time the step function is traced; tests assert it stays put after warm-up.
TRACE_COUNT = [0]


def step(
    params: Params,
    state: DeviceState,
    inp: StepInput,
    *,
    spec: ModelSpec,
    attention: AttentionBackend,
    num_top_logprobs: int,
    logits_shardings: tuple[jax.sharding.Sharding, ...] = (),
) -> tuple[SamplingOutput, PromptLogprobsOutput, jax.Array, DeviceState, jax.Array]:
    """Sampled tokens, the prompt logprobs asked for (zeros unless some row asked), the
    logits the tokens were drawn from (f32[S, V]), the new state, and the sampled tokens
    again in the next step's `prev_token_ids` buffer (i32[P]).

    Async scheduling: the engine packs step N+1 before it has read step N's tokens back, so
    a decode row's input token may still be on the device; `inp.prev_rows` says which row of
    the previous step's buffer holds it (the host never waits for it).

    `logits_shardings`: shardings the logits take in turn before sampling. With tensor
    parallelism: by vocabulary (as the vocab-sharded lm_head makes them; otherwise XLA may
    gather the whole lm_head instead), then replicated: one all-gather of [S, V] rather than
    collectives inside each of sampling's reductions and sorts.

    The logits are an output, not for the caller to read, but so that they get a buffer of
    their own. XLA's CPU runtime allocates all of a run's temporaries as one block; with the
    logits and the sort-based sampling branch's [S, V] temporaries in it, that block exceeds
    glibc's largest mmap threshold (32 MB) from 32 rows up, so every step maps fresh pages
    and page-faults on the whole logits array: 4096 faults per step at S=128, ~8 ms of CPU
    time at ~2 µs each. An output buffer of 16 MB is recycled by malloc instead (decode
    steps 7-9% faster). On accelerators the extra output costs nothing."""
    TRACE_COUNT[0] += 1

    meta = AttentionMetadata(
        kv_lens=inp.kv_lens,
        page_indices=inp.page_indices,
        cu_q_lens=inp.cu_q_lens,
        num_seqs=inp.num_seqs,
        slot_mapping=inp.slot_mapping,
    )
    linked = inp.prev_rows >= 0
    input_ids = jnp.where(
        linked, inp.prev_token_ids[jnp.where(linked, inp.prev_rows, 0)], inp.input_ids
    )
    logits, greedy_ids, kv_caches, hidden = registry.family(spec).forward(
        params,
        state.kv_caches,
        input_ids,
        inp.positions,
        inp.logits_indices,
        meta,
        spec=spec,
        attention=attention,
        num_compute_tokens=inp.num_compute_tokens,
        # Random rows, penalties, logprobs and token masks read the logits; greedy rows only
        # their argmax.
        need_logits=(inp.flags[FLAG_RANDOM] > 0)
        | (inp.flags[FLAG_PENALTY] > 0)
        | (inp.flags[FLAG_LOGPROBS] > 0)
        | (inp.flags[FLAG_MASK] > 0),
    )
    for sharding in logits_shardings:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    penalty_args = (
        inp.penalty_tokens,
        inp.penalty_counts,
        inp.presence_penalty,
        inp.frequency_penalty,
        inp.repetition_penalty,
    )
    out = sample(
        logits,
        temperature=inp.temperature,
        top_k=inp.top_k,
        top_p=inp.top_p,
        min_p=inp.min_p,
        rng_keys=inp.rng_keys,
        sample_counters=inp.sample_counters,
        flags=inp.flags,
        penalty_args=penalty_args,
        num_top_logprobs=num_top_logprobs,
        greedy_ids=greedy_ids,
        num_rows=inp.num_seqs[0],
        token_mask=inp.token_mask,
        any_mask=inp.flags[FLAG_MASK] > 0,
    )
    prompt_out = prompt_logprobs(
        params,
        hidden,
        inp,
        num_top_logprobs=num_top_logprobs,
        logits_shardings=logits_shardings,
        logit_soft_cap=spec.final_logit_soft_cap,
    )
    sampled = jax.lax.dynamic_update_slice(inp.prev_token_ids, out.token_ids, (0,))
    return out, prompt_out, logits, DeviceState(kv_caches), sampled
