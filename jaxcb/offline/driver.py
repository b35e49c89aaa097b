"""The offline driver: one loop that feeds an engine from a planned order and steps it.

`LLM.generate` (jaxcb/llm.py) and the JSONL batch run (batch.py) both hand it their
requests: it submits them in the order `ordering.plan_order` chose, as fast as the caller's
`has_room` allows, holds a request that shares prefix pages with an earlier one until that
one has produced its first token (`StagedSubmission`), steps the engine and passes each
finished request to the caller. What to submit, where results go and what "room" means
(waiting requests for `generate`, requests in flight for a batch run) stay with the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxcb.offline.ordering import StagedSubmission, plan_order
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams


def decode_budget(engine: Any, prompt_ids: Sequence[int], params: SamplingParams) -> int:
    """The most tokens a request may generate (all n samples): what the `auto` order weighs."""
    room = max(1, engine.max_model_len - len(prompt_ids))
    cap = engine.config.limits.max_output_tokens or room
    return min(params.max_tokens or cap, cap, room) * params.n


class OfflineDriver:
    """Steps `engine` and calls `on_finished` with each request that finishes.

    `has_room()`: whether the caller lets one more request in now (checked before each)."""

    def __init__(
        self,
        engine: Any,
        *,
        has_room: Callable[[], bool],
        on_finished: Callable[[RequestOutput], None],
    ) -> None:
        self.engine = engine
        self.has_room = has_room
        self.on_finished = on_finished
        self._on_first_token: dict[str, Callable[[], None]] = {}  # leader id -> release

    def submit_in_order(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        order: str,
        submit: Callable[[int, bool], str | None],
    ) -> None:
        """Submit requests 0..n-1 (`submit(i, final_only)`: the engine request id, or None if
        it was rejected) in `order`, stepping the engine while they wait for room or for a
        leader's first token; returns once every one is submitted (not finished: `drain`)."""
        budgets = [
            decode_budget(self.engine, ids, p) for ids, p in zip(prompt_ids, params, strict=True)
        ]
        page_size = self.engine.config.cache.page_size
        plan = plan_order(prompt_ids, budgets, page_size, order)
        staged = StagedSubmission(plan, hold=self.engine.config.cache.enable_prefix_caching)
        while staged.num_left:
            submitted = False
            while self.has_room():
                i = staged.next_ready()
                if i is None:
                    break
                submitted = True
                leader = staged.is_leader(i)
                # A leader reports every step, so its first token releases its followers.
                request_id = submit(i, not leader)
                if request_id is None:  # rejected: its followers need not wait
                    staged.release(i)
                elif leader:
                    self._on_first_token[request_id] = functools.partial(staged.release, i)
            if self.engine.has_unfinished_requests():
                self.step()
            elif not submitted:  # nothing runs that could release a request or make room
                raise RuntimeError(
                    f"{staged.num_left} requests wait with an idle engine: has_room() is false"
                )

    def drain(self) -> None:
        """Step until every submitted request has finished."""
        while self.engine.has_unfinished_requests():
            self.step()

    def step(self) -> None:
        for out in self.engine.step():
            release = self._on_first_token.get(out.request_id)
            if release is not None and (out.finished or any(o.token_ids for o in out.outputs)):
                del self._on_first_token[out.request_id]
                release()
            if out.finished:
                self.on_finished(out)
