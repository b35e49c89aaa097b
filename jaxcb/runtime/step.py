"""THE step: model forward over a packed ragged batch, KV write, greedy tokens and the
prompt logprobs of the rows that ask for them (runtime/prompt_logprobs.py), then, for the
steps that need more than greedy tokens, the sampling program.

The forward is that of the spec's family (models/registry.py). `step` serves every bucket
(each bucket is compiled once, ahead of time); `sample_step` reads only sequence rows, so it
is compiled once per sequence-row count S and shared by every bucket of that S: sampling's
filters, penalties, masks and logprobs make most of a bucket's compile time on CPU
(docs/architecture.md, "Compile time"), and a bucket set has few distinct S. The runner jits
both with its mesh's shardings (runner.py) and runs `sample_step` after `step` only when
some row is random, penalized, constrained or asks for logprobs (`needs_sampling`): a
greedy step is one program. The device state (the KV pages) is donated, so XLA updates it
in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.models import registry
from jaxcb.models.base import AttentionBackend, AttentionMetadata, ModelSpec, Params
from jaxcb.runtime.kv_cache import DeviceState
from jaxcb.runtime.prompt_logprobs import PromptLogprobsOutput, prompt_logprobs
from jaxcb.runtime.step_input import (
    FLAG_LOGPROBS,
    FLAG_MASK,
    FLAG_PENALTY,
    FLAG_RANDOM,
    Layout,
    SamplingInput,
    StepInput,
    unpack_small,
)
from jaxcb.sampling import SamplingOutput, argmax_last_axis, sample

#: Incremented each time `step` or `sample_step` is traced; tests assert it stays put after
#: warm-up.
TRACE_COUNT = [0]

#: The flags under which a step's tokens are not its greedy tokens, or need more than them.
SAMPLING_FLAGS = np.array([FLAG_RANDOM, FLAG_PENALTY, FLAG_LOGPROBS, FLAG_MASK])


def needs_sampling(flags: np.ndarray) -> bool:
    """Whether a step with these flags (StepInput.flags, on the host) runs `sample_step`."""
    return bool(np.any(flags[SAMPLING_FLAGS] > 0))


def step(
    params: Params,
    state: DeviceState,
    inp: StepInput,
    *,
    spec: ModelSpec,
    attention: AttentionBackend,
    num_top_logprobs: int,
    logits_shardings: tuple[jax.sharding.Sharding, ...] = (),
    scan_layers: bool = True,
) -> tuple[jax.Array, PromptLogprobsOutput, jax.Array, DeviceState, jax.Array]:
    """The greedy tokens (i32[S]), the prompt logprobs asked for (zeros unless some row
    asked), the logits (f32[S, V]: `sample_step` draws from them; only their bf16 screen
    when the native LM head found the greedy tokens without them), the new state, and the
    greedy tokens again in the next step's `prev_token_ids` buffer (i32[P]), which
    `sample_step` overwrites when it runs.

    Async scheduling: the engine packs step N+1 before it has read step N's tokens back, so
    a decode row's input token may still be on the device; `inp.prev_rows` says which row of
    the previous step's buffer holds it (the host never waits for it).

    `logits_shardings`: shardings the logits take in turn before sampling. With tensor
    parallelism: by vocabulary (as the vocab-sharded lm_head makes them; otherwise XLA may
    gather the whole lm_head instead), then replicated: one all-gather of [S, V] rather than
    collectives inside each of sampling's reductions and sorts.

    The logits get a buffer of their own as an output (which `sample_step` needs anyway).
    XLA's CPU runtime allocates all of a run's temporaries as one block; with [S, V] logits
    in it, that block exceeds glibc's largest mmap threshold (32 MB) from 32 rows up, so
    every step would map fresh pages and page-fault on the whole logits array: 4096 faults
    per step at S=128, ~8 ms of CPU time at ~2 µs each. An output buffer of 16 MB is
    recycled by malloc instead (decode steps 7-9% faster)."""
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
        num_logits_rows=inp.num_sample_rows,
        # `sample_step` reads the logits; greedy rows need only their argmax.
        need_logits=jnp.any(inp.flags[SAMPLING_FLAGS] > 0),
        scan_layers=scan_layers,
        lora_slots=inp.lora_slots,
    )
    for sharding in logits_shardings:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    if greedy_ids is None:  # the LM head's kernel did not find them on the way
        greedy_ids = argmax_last_axis(logits)
    prompt_out = prompt_logprobs(
        params,
        hidden,
        inp,
        num_top_logprobs=num_top_logprobs,
        logits_shardings=logits_shardings,
        logit_soft_cap=spec.final_logit_soft_cap,
    )
    greedy_ids = greedy_ids.astype(jnp.int32)
    sampled = jax.lax.dynamic_update_slice(inp.prev_token_ids, greedy_ids, (0,))
    return greedy_ids, prompt_out, logits, DeviceState(kv_caches), sampled


def packed_step(
    params: Params,
    state: DeviceState,
    ints: jax.Array,  # i32[N]: StepInput's small int arrays (step_input.pack_small)
    floats: jax.Array,  # f32[M]: its small float arrays
    large: tuple,  # its LARGE_FIELDS arrays
    layout: Layout,  # (static: where each array sits in the buffers)
    **kwargs: Any,
) -> tuple[jax.Array, PromptLogprobsOutput, jax.Array, DeviceState, jax.Array]:
    """`step` on a StepInput sent as two buffers and its large arrays (what the runner
    compiles: a handful of input arrays rather than one per field)."""
    return step(params, state, unpack_small(ints, floats, large, layout), **kwargs)


def sample_step(
    logits: jax.Array,  # f32[S, V]: `step`'s
    greedy_ids: jax.Array,  # i32[S]: `step`'s
    sampled: jax.Array,  # i32[P]: `step`'s next-step token buffer
    inp: SamplingInput,
    *,
    num_top_logprobs: int,
    platform: str | None = None,
) -> tuple[SamplingOutput, jax.Array]:
    """The step's tokens under every sampling parameter (sampling.py) and the logprobs
    asked for, and the next-step token buffer with them in place of the greedy tokens.
    `platform`: the devices' ("cpu" draws row by row; others all rows at once), known when
    the program is traced, so the other way is not compiled too (~9% of its compile time
    on CPU); None: chosen where the program runs."""
    TRACE_COUNT[0] += 1
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
        num_rows=inp.num_sample_rows[0],
        token_mask=inp.token_mask,
        any_mask=inp.flags[FLAG_MASK] > 0,
        rows_at_once=None if platform is None else platform != "cpu",
    )
    return out, jax.lax.dynamic_update_slice(sampled, out.token_ids, (0,))
