"""What the scheduler decided for one step (`SchedulerOutput`): the chunks of tokens each
request feeds, and the preemptions, swaps and prefix-cache lookups that came with them. The
runner packs it into the step's arrays (runtime/step_input.py); the engine applies the
sampled tokens to its requests afterwards.

Pure Python: no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxcb.engine.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first token fed this step (= num_computed_tokens before)
    num_tokens: int  # tokens fed this step
    # Async scheduling: the row of the step in flight whose sampled token is this chunk's
    # last input token (the host has not read it back yet); -1: every input is on the host.
    prev_sample_row: int = -1
    # Speculative decoding: the proposed tokens fed after the request's newest token (the
    # last `len(draft_token_ids)` of num_tokens); the step samples a token after each of
    # them too, and the engine keeps the proposals its samples confirm (engine/spec/).
    draft_token_ids: tuple[int, ...] = ()
    num_accepted_drafts: int = 0  # of them, those kept (set once the step's tokens are in)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """The chunk reaches the newest token, so the step samples the next one. (Asked
        before the step runs: the tokens it samples move the request's newest token on.)"""
        return self.end - self.num_draft_tokens == self.request.num_tokens

    @property
    def num_sample_rows(self) -> int:
        """Rows of the step's logits and sampling that are this chunk's: one after its last
        token (used only when it `samples`), and one after each proposed token."""
        return 1 + self.num_draft_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose rows score the next prompt token for the request's
        prompt logprobs (those still missing: a recompute does not score a token twice)."""
        first = self.request.next_prompt_logprob_position
        if first is None:
            return range(0)
        return range(max(self.start, first), min(self.end, self.request.num_prompt_tokens - 1))


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)
    # Prefix cache, over the requests admitted this step: tokens looked up, tokens found.
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Padding slots a padded-batch baseline (engine/sched/baselines.py) adds to the step; 0 here.
    num_padding_tokens: int = 0
    # Preemption by swap: K/V pages to copy to host slots, (page, slot), and back, (slot,
    # page). The runner does both before the step runs, out first (Runner.swap): a victim's
    # pages may be handed to another request in the same step. Victims swapped out, swapped
    # requests resumed, victims recomputed because the host pool was full.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # LoRA: adapters to write into device slots before the step runs, (slot, lora_int_id)
    # (Runner.load_lora_slot): an admitted request's adapter that was in no slot.
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0
    # Tokens whose K/V this step's preemptions dropped (computed again when they resume).
    num_recomputed_tokens: int = 0
    # After admission: pages promised to running requests, not yet allocated; the current
    # output length prediction (None: nothing finished yet).
    admitted_idle_pages: int = 0
    predicted_output_len: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.num_tokens == 1 + c.num_draft_tokens and c.samples)

    @property
    def num_draft_tokens(self) -> int:
        return sum(c.num_draft_tokens for c in self.chunks)

    @property
    def num_sample_rows(self) -> int:
        """Logits and sampling rows the step needs (see `sample_row_starts`)."""
        return sum(c.num_sample_rows for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def sample_row_starts(chunks: list[ScheduledChunk]) -> list[int]:
    """Each chunk's first row among the step's sampling rows: the chunks' rows follow one
    another, one each, plus one per proposed token (speculative decoding). Without
    proposals, row s is chunk s's."""
    starts, row = [], 0
    for chunk in chunks:
        starts.append(row)
        row += chunk.num_sample_rows
    return starts
