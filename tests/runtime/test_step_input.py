"""pack_step_input on a constructed batch: a decode, a mid-prompt chunk and a last chunk."""

from __future__ import annotations

import numpy as np

from jaxcb.engine.buckets import Bucket
from jaxcb.engine.request import Request
from jaxcb.engine.sched.schedule import ScheduledChunk, SchedulerOutput
from jaxcb.runtime.step_input import (
    FLAG_LOGPROBS,
    FLAG_PENALTY,
    FLAG_PROMPT_TOP_LOGPROBS,
    FLAG_RANDOM,
    FLAG_TOP_LOGPROBS,
    PENALTY_PAD,
    pack_step_input,
)
from jaxcb.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention import PADDING_SLOT

PAGE = 4


def request(rid: str, prompt: list[int], pages: list[int], params: SamplingParams, seed: int):
    req = Request(rid, prompt, params, seed, 8, frozenset(), 0.0)
    req.page_ids = pages
    return req


def pack(sched, bucket, *, pages_per_seq, max_model_len, top_logprobs):
    return pack_step_input(
        sched,
        bucket,
        page_size=PAGE,
        pages_per_seq=pages_per_seq,
        max_model_len=max_model_len,
        num_top_logprobs=top_logprobs,
    )


def test_chunks_laid_out_on_the_token_axis():
    greedy = SamplingParams(temperature=0)
    # decoding: 5 prompt tokens + 1 output, the newest (position 5) is fed
    dec = request("dec", [1, 2, 3, 4, 5], [7, 3], greedy, seed=(9 << 32) | 11)
    dec.append_token(6)
    # a long prompt, its middle chunk (positions 2..5): samples nothing this step
    mid = request(
        "mid",
        [10, 11, 12, 13, 14, 15, 16, 17],
        [0, 5],
        SamplingParams(temperature=0.7, top_k=3, presence_penalty=0.5),
        seed=1,
    )
    # the last chunk of a prompt (positions 4..6): samples, with logprobs
    last = request(
        "last",
        [20, 21, 22, 23, 24, 25, 26],
        [2, 9],
        SamplingParams(temperature=0, logprobs=2),
        seed=2,
    )
    sched = SchedulerOutput(
        chunks=[ScheduledChunk(dec, 5, 1), ScheduledChunk(mid, 2, 4), ScheduledChunk(last, 4, 3)]
    )
    inp = pack(sched, Bucket(16, 4), pages_per_seq=3, max_model_len=32, top_logprobs=5)
    np.testing.assert_array_equal(inp.input_ids[:8], [6, 12, 13, 14, 15, 24, 25, 26])
    np.testing.assert_array_equal(inp.positions[:8], [5, 2, 3, 4, 5, 4, 5, 6])
    # slot = page_ids[pos // 4] * 4 + pos % 4
    np.testing.assert_array_equal(inp.slot_mapping[:8], [13, 2, 3, 20, 21, 36, 37, 38])
    assert (inp.slot_mapping[8:] == PADDING_SLOT).all() and (inp.input_ids[8:] == 0).all()
    np.testing.assert_array_equal(inp.cu_q_lens, [0, 1, 5, 8, 8])
    np.testing.assert_array_equal(inp.kv_lens, [6, 6, 7, 0])
    np.testing.assert_array_equal(inp.logits_indices, [0, 4, 7, 0])
    np.testing.assert_array_equal(inp.page_indices, [[7, 3, 0], [0, 5, 0], [2, 9, 0], [0, 0, 0]])
    assert inp.num_seqs[0] == 3
    assert inp.num_compute_tokens[0] == 8  # the matmuls skip the bucket's 8 padding rows
    np.testing.assert_array_equal(inp.num_prompt_tokens, [5, 8, 7, 0])
    np.testing.assert_array_equal(inp.sample_counters, [1, 0, 0, 0])
    np.testing.assert_array_equal(inp.rng_keys[:3], [[9, 11], [0, 1], [0, 2]])
    np.testing.assert_allclose(inp.temperature, [0, 0.7, 0, 0])
    assert inp.top_k[1] == 3 and inp.presence_penalty[1] == np.float32(0.5)
    # flags count sampling rows only: `mid` (random, penalties) samples nothing this step
    assert inp.flags[FLAG_RANDOM] == 0 and inp.flags[FLAG_PENALTY] == 0
    assert inp.flags[FLAG_LOGPROBS] == 1 and inp.flags[FLAG_TOP_LOGPROBS] == 1
    assert inp.penalty_tokens is None and inp.penalty_counts is None


def test_a_baselines_batch_padding_is_computed():
    """Static/dynamic batching's padding is work a padded batch really does: it is counted in
    the rows the matmuls compute (capped at the bucket); the bucket's rounding is not."""
    req = request("a", [1, 2, 3], [0], SamplingParams(temperature=0), seed=0)
    for padding, want in [(0, 3), (5, 8), (40, 16)]:
        sched = SchedulerOutput(chunks=[ScheduledChunk(req, 0, 3)], num_padding_tokens=padding)
        inp = pack(sched, Bucket(16, 4), pages_per_seq=2, max_model_len=8, top_logprobs=0)
        assert inp.num_compute_tokens[0] == want


def test_penalty_rows_carry_each_sequence_history():
    params = SamplingParams(temperature=0.5, repetition_penalty=1.2)
    a = request("a", [1, 2, 3], [0], params, seed=0)
    a.append_token(4)
    sched = SchedulerOutput(chunks=[ScheduledChunk(a, 3, 1)])
    inp = pack(sched, Bucket(16, 2), pages_per_seq=2, max_model_len=8, top_logprobs=0)
    assert inp.flags[FLAG_RANDOM] == 1 and inp.flags[FLAG_PENALTY] == 1
    pad = PENALTY_PAD + np.arange(8)
    np.testing.assert_array_equal(inp.penalty_tokens, [[1, 2, 3, 4, *pad[4:]], pad])
    np.testing.assert_array_equal(inp.penalty_counts, [[0, 0, 0, 1, 0, 0, 0, 0], [0] * 8])
    assert inp.flags[FLAG_TOP_LOGPROBS] == 0


def test_prompt_logprob_rows_follow_the_chunks():
    """Rows score the next prompt token from the first position not scored yet (a recompute
    after preemption scores nothing twice) to the prompt's last but one; the engine reads
    the results back in the same order."""
    from jaxcb.engine.interface import StepResult
    from jaxcb.engine.logprobs import record_prompt_logprobs

    dec = request("dec", [1, 2, 3, 4, 5], [7, 3], SamplingParams(temperature=0), seed=0)
    dec.append_token(6)
    # positions 2..5 of 8, positions 0 and 1 already scored before a preemption
    mid = request("mid", [10, 11, 12, 13, 14, 15, 16, 17], [0, 5], SamplingParams(), seed=1)
    mid.prompt_logprobs = [None, {11: -1.0}, {12: -1.0}]
    # positions 2..6 of 7 recomputed, tokens 1..3 already scored (by positions 0..2);
    # position 6 samples the first output token instead
    last = request("last", [20, 21, 22, 23, 24, 25, 26], [2, 9], SamplingParams(), seed=2)
    last.params.prompt_logprobs = 2
    last.prompt_logprobs = [None] + [{t: -1.0} for t in (21, 22, 23)]
    sched = SchedulerOutput(
        chunks=[ScheduledChunk(dec, 5, 1), ScheduledChunk(mid, 2, 4), ScheduledChunk(last, 2, 5)]
    )
    inp = pack(sched, Bucket(16, 4), pages_per_seq=3, max_model_len=32, top_logprobs=5)
    assert inp.num_prompt_logprob_rows[0] == 7
    np.testing.assert_array_equal(inp.prompt_logprob_rows[:7], [1, 2, 3, 4, 6, 7, 8])
    np.testing.assert_array_equal(inp.prompt_logprob_targets[:7], [13, 14, 15, 16, 24, 25, 26])
    assert inp.flags[FLAG_PROMPT_TOP_LOGPROBS] == 1

    top_ids = np.arange(35, dtype=np.int32).reshape(7, 5)  # row i: 5i .. 5i + 4
    result = StepResult(
        np.zeros(3, np.int32),
        np.zeros(3, np.float32),
        None,
        None,
        prompt_logprobs=-np.arange(7, dtype=np.float32),
        prompt_top_token_ids=top_ids,
        prompt_top_logprobs=np.full((7, 5), -9.0, np.float32),
    )
    record_prompt_logprobs(sched.chunks, result)
    assert mid.prompt_logprobs[3:] == [{13: 0.0}, {14: -1.0}, {15: -2.0}, {16: -3.0}]
    # the prompt token first, then the top 2 (25 is among them at row 5: its value stays)
    assert last.prompt_logprobs[4:] == [
        {24: -4.0, 20: -9.0, 21: -9.0},
        {25: -5.0, 26: -9.0},
        {26: -6.0, 30: -9.0, 31: -9.0},
    ]
    assert list(last.prompt_logprobs[5]) == [25, 26]
    assert mid.next_prompt_logprob_position == 6  # its next chunk scores 17
    assert last.next_prompt_logprob_position is None  # done

    plain = pack(
        SchedulerOutput(chunks=[ScheduledChunk(dec, 5, 1)]),
        Bucket(16, 4),
        pages_per_seq=3,
        max_model_len=32,
        top_logprobs=5,
    )
    assert plain.num_prompt_logprob_rows[0] == 0 and plain.flags[FLAG_PROMPT_TOP_LOGPROBS] == 0


def test_a_token_in_flight_is_linked_to_its_row():
    """Async scheduling: `dec`'s newest token is still being sampled by the step in flight
    (row 2 there): its input row takes that row's token on device, the host packs 0, and
    its seeded draw counts the token in flight among those generated."""
    greedy = SamplingParams(temperature=0)
    dec = request("dec", [1, 2, 3, 4, 5], [7, 3], greedy, seed=0)
    dec.append_token(6)
    dec.num_inflight = 1  # token 7, at position 6
    other = request("other", [10, 11, 12], [4], greedy, seed=1)
    other.append_token(13)
    sched = SchedulerOutput(
        chunks=[ScheduledChunk(other, 3, 1), ScheduledChunk(dec, 6, 1, prev_sample_row=2)]
    )
    inp = pack(sched, Bucket(16, 4), pages_per_seq=3, max_model_len=32, top_logprobs=0)
    np.testing.assert_array_equal(inp.input_ids[:2], [13, 0])
    np.testing.assert_array_equal(inp.prev_rows[:3], [-1, 2, -1])
    assert (inp.prev_rows[2:] == -1).all() and inp.prev_token_ids is None
    np.testing.assert_array_equal(inp.positions[:2], [3, 6])
    np.testing.assert_array_equal(inp.kv_lens[:2], [4, 7])
    np.testing.assert_array_equal(inp.sample_counters[:2], [1, 2])
