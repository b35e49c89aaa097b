"""StepInput: the fixed-shape arrays one step consumes, and the host-side packer that fills them.

Shapes depend only on the bucket (T token rows, S sequence rows) and on the engine's
`pages_per_seq` (W) and `max_model_len` (M), so one compiled step serves every batch that
fits the bucket. Rows past the real batch are padding: their slots point outside the page
pool (nothing is written) and attention ignores them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from jaxcb.engine.buckets import Bucket
from jaxcb.engine.scheduler import SchedulerOutput
from pallas_kernels.ragged_paged_attention import PADDING_SLOT

FLAG_RANDOM, FLAG_PENALTY, FLAG_LOGPROBS, FLAG_TOP_LOGPROBS = 0, 1, 2, 3


@dataclass
class StepInput:
    # token rows
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]: page * page_size + offset, PADDING_SLOT for padding
    # sequence rows (attention metadata)
    cu_q_lens: np.ndarray  # i32[S + 1]
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, W]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]: the row of each sequence's last token
    # sequence rows (sampling)
    num_prompt_tokens: np.ndarray  # i32[S]
    temperature: np.ndarray  # f32[S]
    top_k: np.ndarray  # i32[S]
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    rng_keys: np.ndarray  # u32[S, 2]
    sample_counters: np.ndarray  # i32[S]: tokens generated so far
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]
    flags: np.ndarray  # i32[4]: any random row / penalties / logprobs / top logprobs
    # i32[S, M]: each row's tokens so far, for penalties; None (a device-resident zero array
    # is used) unless some row has penalties, so most steps send nothing this size.
    penalty_tokens: np.ndarray | jax.Array | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


jax.tree_util.register_dataclass(
    StepInput, data_fields=[f.name for f in dataclasses.fields(StepInput)], meta_fields=[]
)


def empty_step_input(bucket: Bucket, pages_per_seq: int, max_model_len: int) -> StepInput:
    """An all-padding input of the bucket's shapes (used for compilation)."""
    t, s = bucket.num_tokens, bucket.num_seqs
    i32, f32 = np.int32, np.float32
    return StepInput(
        input_ids=np.zeros(t, i32),
        positions=np.zeros(t, i32),
        slot_mapping=np.full(t, PADDING_SLOT, i32),
        cu_q_lens=np.zeros(s + 1, i32),
        kv_lens=np.zeros(s, i32),
        page_indices=np.zeros((s, pages_per_seq), i32),
        num_seqs=np.zeros(1, i32),
        logits_indices=np.zeros(s, i32),
        num_prompt_tokens=np.zeros(s, i32),
        temperature=np.zeros(s, f32),
        top_k=np.zeros(s, i32),
        top_p=np.ones(s, f32),
        min_p=np.zeros(s, f32),
        rng_keys=np.zeros((s, 2), np.uint32),
        sample_counters=np.zeros(s, i32),
        presence_penalty=np.zeros(s, f32),
        frequency_penalty=np.zeros(s, f32),
        repetition_penalty=np.ones(s, f32),
        flags=np.zeros(4, i32),
        penalty_tokens=np.zeros((s, max_model_len), i32),
    )


def pack_step_input(
    sched: SchedulerOutput,
    bucket: Bucket,
    *,
    page_size: int,
    pages_per_seq: int,
    max_model_len: int,
    num_top_logprobs: int,
) -> StepInput:
    """Lay the scheduled chunks out on the token axis, padded to the bucket."""
    inp = empty_step_input(bucket, pages_per_seq, max_model_len=1)
    inp.penalty_tokens = None
    offset = 0
    for s, chunk in enumerate(sched.chunks):
        req, n, start, end = chunk.request, chunk.num_tokens, chunk.start, chunk.end
        rows = slice(offset, offset + n)
        positions = np.arange(start, end, dtype=np.int32)
        pages = np.asarray(req.page_ids, dtype=np.int32)
        inp.input_ids[rows] = req.token_ids[start:end]
        inp.positions[rows] = positions
        inp.slot_mapping[rows] = pages[positions // page_size] * page_size + positions % page_size
        offset += n
        inp.cu_q_lens[s + 1] = offset
        inp.kv_lens[s] = end
        inp.page_indices[s, : len(pages)] = pages
        inp.logits_indices[s] = offset - 1
        inp.num_prompt_tokens[s] = req.num_prompt_tokens

        p = req.params
        inp.temperature[s] = p.temperature
        inp.top_k[s] = p.effective_top_k
        inp.top_p[s] = p.top_p
        inp.min_p[s] = p.min_p
        inp.rng_keys[s] = (req.seed >> 32) & 0xFFFFFFFF, req.seed & 0xFFFFFFFF
        inp.sample_counters[s] = len(req.output_token_ids)
        inp.presence_penalty[s] = p.presence_penalty
        inp.frequency_penalty[s] = p.frequency_penalty
        inp.repetition_penalty[s] = p.repetition_penalty
        if chunk.samples:
            inp.flags[FLAG_RANDOM] |= p.temperature > 0
            inp.flags[FLAG_PENALTY] |= p.uses_penalties
            inp.flags[FLAG_LOGPROBS] |= p.logprobs is not None
            inp.flags[FLAG_TOP_LOGPROBS] |= (p.logprobs or 0) > 0 and num_top_logprobs > 0
    if inp.flags[FLAG_PENALTY]:
        inp.penalty_tokens = np.zeros((bucket.num_seqs, max_model_len), np.int32)
        for s, chunk in enumerate(sched.chunks):
            inp.penalty_tokens[s, : chunk.end] = chunk.request.token_ids[: chunk.end]
    num_seqs = len(sched.chunks)
    inp.cu_q_lens[num_seqs + 1 :] = offset
    inp.num_seqs[0] = num_seqs
    return inp
