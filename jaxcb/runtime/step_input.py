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
import jax.numpy as jnp
import numpy as np

from jaxcb.engine.buckets import Bucket
from jaxcb.engine.grammar import fill_masks
from jaxcb.engine.sched.schedule import ScheduledChunk, SchedulerOutput
from pallas_kernels.ragged_paged_attention import PADDING_SLOT

FLAG_RANDOM, FLAG_PENALTY, FLAG_LOGPROBS, FLAG_TOP_LOGPROBS = 0, 1, 2, 3
FLAG_PROMPT_TOP_LOGPROBS = 4  # some prompt logprob row wants its top-k too
FLAG_MASK = 5  # some sampled row is constrained (structured outputs): token_mask applies
NUM_FLAGS = 6
#: Vocabulary ids per word of a packed token mask (bit i of word w: id 32 w + i allowed).
MASK_WORD_BITS = 32


@dataclass
class StepInput:
    # token rows
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]: page * page_size + offset, PADDING_SLOT for padding
    lora_slots: np.ndarray  # i32[T]: the LoRA adapter slot of each row's request (0: none)
    # token rows that score the next prompt token (prompt logprobs), first in the arrays,
    # and that token; how many (0: the step computes no prompt logprobs)
    prompt_logprob_rows: np.ndarray  # i32[T]
    prompt_logprob_targets: np.ndarray  # i32[T]
    num_prompt_logprob_rows: np.ndarray  # i32[1]
    # sequence rows (attention metadata)
    cu_q_lens: np.ndarray  # i32[S + 1]
    kv_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[S, W]
    num_seqs: np.ndarray  # i32[1]
    # i32[1]: token rows the matmuls must compute: the real ones plus a batching baseline's
    # padding (SchedulerOutput.num_padding_tokens), not the bucket's rounding
    num_compute_tokens: np.ndarray
    # sampling rows: one per sequence, plus one per proposed token (speculative decoding;
    # ScheduledChunk.num_sample_rows): the first num_sample_rows of the S rows below
    num_sample_rows: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]: the token row each sampling row's logits are of
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
    # i32[NUM_FLAGS]: any random row / penalties / logprobs / top logprobs / prompt top-k /
    # a constrained row
    flags: np.ndarray
    # Penalties (`penalty_arrays`): i32[S, M] each row's distinct tokens so far (prompt and
    # output), ascending, then PENALTY_PAD + column; f32[S, M] how often each came out. None
    # (device-resident padding is used) unless some row has penalties, so most steps send
    # nothing this size.
    penalty_tokens: np.ndarray | jax.Array | None
    penalty_counts: np.ndarray | jax.Array | None
    # Async scheduling (engine/llm_engine.py): a decode row whose input token the previous
    # step sampled, not yet read back by the host, takes it on device: prev_rows[t] is that
    # token's row in the previous step's sampled tokens, -1 where input_ids holds the token.
    prev_rows: np.ndarray  # i32[T]
    # i32[P]: the previous step's sampled tokens (its first S rows), the runner's device
    # buffer; P is the runner's largest bucket's S, the same for every bucket. None when
    # packed: the runner fills it in.
    prev_token_ids: np.ndarray | jax.Array | None
    # Structured outputs: i32[S, ceil(V / 32)] each row's allowed next tokens, packed (-1:
    # all). None (device-resident all-allowed rows are used) unless some row is constrained.
    token_mask: np.ndarray | jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


jax.tree_util.register_dataclass(
    StepInput, data_fields=[f.name for f in dataclasses.fields(StepInput)], meta_fields=[]
)


@dataclass
class SamplingInput:
    """The sequence rows of a StepInput that `sample_step` reads (views of its arrays): its
    shapes depend on S alone, so one sampling program serves every bucket of that S."""

    num_sample_rows: np.ndarray | jax.Array
    temperature: np.ndarray | jax.Array
    top_k: np.ndarray | jax.Array
    top_p: np.ndarray | jax.Array
    min_p: np.ndarray | jax.Array
    rng_keys: np.ndarray | jax.Array
    sample_counters: np.ndarray | jax.Array
    presence_penalty: np.ndarray | jax.Array
    frequency_penalty: np.ndarray | jax.Array
    repetition_penalty: np.ndarray | jax.Array
    flags: np.ndarray | jax.Array
    penalty_tokens: np.ndarray | jax.Array
    penalty_counts: np.ndarray | jax.Array
    token_mask: np.ndarray | jax.Array


jax.tree_util.register_dataclass(
    SamplingInput, data_fields=[f.name for f in dataclasses.fields(SamplingInput)], meta_fields=[]
)


def sampling_input(inp: StepInput) -> SamplingInput:
    """The sampling rows of a packed step (its penalty and mask arrays filled in)."""
    names = [f.name for f in dataclasses.fields(SamplingInput)]
    return SamplingInput(**{name: getattr(inp, name) for name in names})


#: StepInput's arrays that go to the device as they are (large, or already there); the
#: rest travel in two buffers (`pack_small`): one int32, one float32.
LARGE_FIELDS = ("penalty_tokens", "penalty_counts", "prev_token_ids", "token_mask")
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
INT_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(StepInput)
    if f.name not in LARGE_FIELDS and f.name not in FLOAT_FIELDS
)

#: Where each small array sits in its buffer: ((name, shape), ...) per buffer, in field
#: order; hashable (a static argument of the jitted step, one per bucket's shapes).
Layout = tuple[tuple[tuple[str, tuple[int, ...]], ...], tuple[tuple[str, tuple[int, ...]], ...]]


def small_layout(inp: StepInput) -> Layout:
    """The layout of `inp`'s small arrays in the two buffers `pack_small` fills."""
    return (
        tuple((name, getattr(inp, name).shape) for name in INT_FIELDS),
        tuple((name, getattr(inp, name).shape) for name in FLOAT_FIELDS),
    )


def pack_small(inp: StepInput) -> tuple[np.ndarray, np.ndarray]:
    """(i32 buffer, f32 buffer) holding `inp`'s small arrays back to back (rng_keys' uint32
    bits as int32): the step takes a handful of arrays whatever StepInput's field count,
    and PjRt handles each array of a call on every step."""
    ints = np.concatenate([getattr(inp, name).view(np.int32).ravel() for name in INT_FIELDS])
    floats = np.concatenate([getattr(inp, name).ravel() for name in FLOAT_FIELDS])
    return ints, floats.astype(np.float32, copy=False)


def unpack_small(ints: jax.Array, floats: jax.Array, large: tuple, layout: Layout) -> StepInput:
    """The StepInput `pack_small` packed (traced: static slices of the two buffers), with
    the LARGE_FIELDS arrays `large` in their order."""
    fields: dict[str, jax.Array] = dict(zip(LARGE_FIELDS, large, strict=True))
    for buffer, part in zip((ints, floats), layout, strict=True):
        start = 0
        for name, shape in part:
            size = int(np.prod(shape, dtype=np.int64))
            fields[name] = buffer[start : start + size].reshape(shape)
            start += size
    fields["rng_keys"] = jax.lax.bitcast_convert_type(fields["rng_keys"], jnp.uint32)
    return StepInput(**fields)


def empty_step_input(
    bucket: Bucket,
    pages_per_seq: int,
    max_model_len: int,
    num_sampled_rows: int = 0,
    vocab_size: int = 1,
) -> StepInput:
    """An all-padding input of the bucket's shapes (used for compilation); the previous
    step's token buffer holds `num_sampled_rows` (at least the bucket's S), the token mask
    `vocab_size` ids a row."""
    t, s = bucket.num_tokens, bucket.num_seqs
    i32, f32 = np.int32, np.float32
    penalty_tokens, penalty_counts = no_penalties(s, max_model_len)
    return StepInput(
        input_ids=np.zeros(t, i32),
        positions=np.zeros(t, i32),
        slot_mapping=np.full(t, PADDING_SLOT, i32),
        lora_slots=np.zeros(t, i32),
        prompt_logprob_rows=np.zeros(t, i32),
        prompt_logprob_targets=np.zeros(t, i32),
        num_prompt_logprob_rows=np.zeros(1, i32),
        cu_q_lens=np.zeros(s + 1, i32),
        kv_lens=np.zeros(s, i32),
        page_indices=np.zeros((s, pages_per_seq), i32),
        num_seqs=np.zeros(1, i32),
        num_compute_tokens=np.zeros(1, i32),
        num_sample_rows=np.zeros(1, i32),
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
        flags=np.zeros(NUM_FLAGS, i32),
        penalty_tokens=penalty_tokens,
        penalty_counts=penalty_counts,
        prev_rows=np.full(t, -1, i32),
        prev_token_ids=np.zeros(max(s, num_sampled_rows), i32),
        token_mask=all_tokens_allowed(s, vocab_size),
    )


def all_tokens_allowed(num_rows: int, vocab_size: int) -> np.ndarray:
    """A packed token mask that allows every id."""
    return np.full((num_rows, -(-vocab_size // MASK_WORD_BITS)), -1, np.int32)


def pack_step_input(
    sched: SchedulerOutput,
    bucket: Bucket,
    *,
    page_size: int,
    pages_per_seq: int,
    max_model_len: int,
    num_top_logprobs: int,
    vocab_size: int = 1,
) -> StepInput:
    """Lay the scheduled chunks out on the token axis, padded to the bucket.

    Per-sequence values are collected in lists and written with one array assignment each:
    element-wise numpy writes cost ~10 µs per sequence, over a millisecond per step of 128.
    """
    inp = empty_step_input(bucket, pages_per_seq, max_model_len=1)
    inp.penalty_tokens = inp.penalty_counts = inp.prev_token_ids = inp.token_mask = None
    chunks = sched.chunks
    num_seqs = len(chunks)
    reqs = [c.request for c in chunks]
    params = [r.params for r in reqs]
    starts = np.fromiter((c.start for c in chunks), np.int32, num_seqs)
    lens = np.fromiter((c.num_tokens for c in chunks), np.int32, num_seqs)
    ends = starts + lens
    cu = np.cumsum(lens, dtype=np.int32)
    total = int(cu[-1]) if num_seqs else 0

    token_ids: list[int] = []
    for c in chunks:
        token_ids += c.request.token_ids[c.start : c.end - c.num_draft_tokens]
        if c.prev_sample_row >= 0:  # its last token is still on the device (async scheduling)
            token_ids.append(0)
        token_ids += c.draft_token_ids
    seq_of_row = np.repeat(np.arange(num_seqs, dtype=np.int32), lens)
    positions = np.arange(total, dtype=np.int32) + np.repeat(starts - (cu - lens), lens)
    for s, req in enumerate(reqs):
        inp.page_indices[s, : len(req.page_ids)] = req.page_ids
    pages = inp.page_indices[seq_of_row, positions // page_size]
    inp.input_ids[:total] = token_ids
    inp.positions[:total] = positions
    inp.slot_mapping[:total] = pages * page_size + positions % page_size
    lora_slots = [r.lora_slot for r in reqs]
    if any(lora_slots):
        inp.lora_slots[:total] = np.repeat(np.asarray(lora_slots, np.int32), lens)

    inp.cu_q_lens[1 : num_seqs + 1] = cu
    inp.cu_q_lens[num_seqs + 1 :] = total
    inp.kv_lens[:num_seqs] = ends
    linked = [(s, c.prev_sample_row) for s, c in enumerate(chunks) if c.prev_sample_row >= 0]
    if linked:
        rows, prev = zip(*linked, strict=True)
        inp.prev_rows[cu[list(rows)] - 1] = prev
    inp.num_seqs[0] = num_seqs
    inp.num_compute_tokens[0] = min(total + sched.num_padding_tokens, bucket.num_tokens)

    # Sampling rows: a chunk's first samples after its last token that is not a proposal,
    # each next one after the next proposal (speculative decoding); row j of a request
    # draws as its (j + 1)-th next token would without speculation: the same key, and the
    # same count of tokens before it.
    drafts = np.fromiter((c.num_draft_tokens for c in chunks), np.int32, num_seqs)
    num_rows = num_seqs + int(drafts.sum())
    chunk_of = np.repeat(np.arange(num_seqs), drafts + 1)
    first_row = np.cumsum(drafts + 1) - drafts - 1
    offset = np.arange(num_rows, dtype=np.int32) - np.repeat(first_row, drafts + 1)
    inp.num_sample_rows[0] = num_rows
    inp.logits_indices[:num_rows] = (cu - 1 - drafts)[chunk_of] + offset

    def per_row(values: list) -> list | np.ndarray:
        """A value per sequence as a value per sampling row (the list itself without
        proposals: numpy writes a list in one assignment)."""
        return values if num_rows == num_seqs else np.asarray(values)[chunk_of]

    inp.num_prompt_tokens[:num_rows] = per_row([r.num_prompt_tokens for r in reqs])
    # (tokens generated so far: those read back, and the one a step in flight is sampling)
    inp.sample_counters[:num_rows] = per_row(
        [len(r.output_token_ids) + r.num_inflight for r in reqs]
    )
    if num_rows > num_seqs:
        inp.sample_counters[:num_rows] += offset
    inp.rng_keys[:num_rows, 0] = per_row([(r.seed >> 32) & 0xFFFFFFFF for r in reqs])
    inp.rng_keys[:num_rows, 1] = per_row([r.seed & 0xFFFFFFFF for r in reqs])
    inp.temperature[:num_rows] = per_row([p.temperature for p in params])
    inp.top_k[:num_rows] = per_row([p.effective_top_k for p in params])
    inp.top_p[:num_rows] = per_row([p.top_p for p in params])
    inp.min_p[:num_rows] = per_row([p.min_p for p in params])
    inp.presence_penalty[:num_rows] = per_row([p.presence_penalty for p in params])
    inp.frequency_penalty[:num_rows] = per_row([p.frequency_penalty for p in params])
    inp.repetition_penalty[:num_rows] = per_row([p.repetition_penalty for p in params])

    sampling = [p for c, p in zip(chunks, params, strict=True) if c.samples]
    inp.flags[FLAG_RANDOM] = any(p.temperature > 0 for p in sampling)
    inp.flags[FLAG_PENALTY] = any(p.uses_penalties for p in sampling)
    inp.flags[FLAG_LOGPROBS] = any(p.logprobs is not None for p in sampling)
    inp.flags[FLAG_TOP_LOGPROBS] = num_top_logprobs > 0 and any(
        (p.logprobs or 0) > 0 for p in sampling
    )
    constrained = [
        (int(first_row[s]), c.request.grammar) for s, c in enumerate(chunks) if c.samples
    ]
    constrained = [(row, grammar) for row, grammar in constrained if grammar is not None]
    if constrained:  # each constrained row's mask from its grammar; the others allow all
        # (a constrained request is never given proposals: its mask after one would need
        # the grammar advanced past it; engine/spec/)
        inp.flags[FLAG_MASK] = 1
        inp.token_mask = all_tokens_allowed(bucket.num_seqs, vocab_size)
        fill_masks(constrained, inp.token_mask)
    if any(r.prompt_logprobs is not None for r in reqs):
        _pack_prompt_logprob_rows(inp, chunks, cu - lens, num_top_logprobs)
    if inp.flags[FLAG_PENALTY]:
        # A row linked to a step in flight lacks its newest token here; the engine links no
        # row with penalties (their history is read here, on the host), so such a row's
        # history is never used.
        # (a proposal's row counts the proposals before it, as if they were output)
        inp.penalty_tokens, inp.penalty_counts = penalty_arrays(
            [
                c.request.token_ids[: c.end - c.num_draft_tokens] + list(c.draft_token_ids[:j])
                for c in chunks
                for j in range(c.num_sample_rows)
            ],
            list(per_row([c.request.num_prompt_tokens for c in chunks])),
            num_rows=bucket.num_seqs,
            max_model_len=max_model_len,
        )
    return inp


#: Token id of penalty padding (plus its column): past any vocabulary, so the device's
#: scatter drops it, and distinct per column, so every (row, id) index is unique and sorted.
PENALTY_PAD = 1 << 30


def no_penalties(num_rows: int, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Penalty arrays of rows without history: padding only."""
    pad = PENALTY_PAD + np.arange(max_model_len, dtype=np.int32)
    return np.tile(pad, (num_rows, 1)), np.zeros((num_rows, max_model_len), np.float32)


def penalty_arrays(
    histories: list, num_prompt_tokens: list[int], *, num_rows: int, max_model_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(distinct tokens, output counts) per row, as the device's penalties take them: each
    row's distinct tokens of prompt and output ascending, padded by PENALTY_PAD + column,
    and how many times each occurs in the output (0: prompt only). Sorted, unique (row, id)
    pairs let the device scatter without sorting them (TPUs sort a scatter's indices
    otherwise: 256 x 8,192 of them at the 8B preset's shapes)."""
    ids, counts = no_penalties(num_rows, max_model_len)
    for row, (history, prompt_len) in enumerate(zip(histories, num_prompt_tokens, strict=True)):
        distinct, where = np.unique(np.asarray(history, np.int32), return_inverse=True)
        ids[row, : len(distinct)] = distinct
        counts[row, : len(distinct)] = np.bincount(where[prompt_len:], minlength=len(distinct))
    return ids, counts


def _pack_prompt_logprob_rows(
    inp: StepInput, chunks: list[ScheduledChunk], row_starts: np.ndarray, num_top_logprobs: int
) -> None:
    """The rows whose logits score the next prompt token, and those tokens, chunk by chunk
    (the order the engine reads the results back in: engine/logprobs.py)."""
    rows: list[int] = []
    targets: list[int] = []
    want_top = False
    for chunk, row_start in zip(chunks, row_starts.tolist(), strict=True):
        positions = chunk.prompt_logprob_positions
        if not positions:
            continue
        first_row = row_start + positions.start - chunk.start
        rows += range(first_row, first_row + len(positions))
        targets += chunk.request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        want_top |= bool(chunk.request.params.prompt_logprobs)
    inp.prompt_logprob_rows[: len(rows)] = rows
    inp.prompt_logprob_targets[: len(targets)] = targets
    inp.num_prompt_logprob_rows[0] = len(rows)
    inp.flags[FLAG_PROMPT_TOP_LOGPROBS] = want_top and num_top_logprobs > 0
