"""A user request as the engine keeps it: its n samples (one `Request` each, scheduled on their
own) with their detokenizers, and the `RequestOutput` built from them."""

from __future__ import annotations

from dataclasses import dataclass

from jaxcb.engine.detokenizer import IncrementalDetokenizer
from jaxcb.engine.request import Request
from jaxcb.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class RequestGroup:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    final_only: bool = False  # step() reports it once, when finished (offline generate)
    broken: bool = False  # building its output failed: texts are no longer available

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def detokenizer(self, child: Request) -> IncrementalDetokenizer:
        return self.detokenizers[self.children.index(child)]

    def output(self) -> RequestOutput:
        """The group's RequestOutput as of now (cumulative texts and tokens)."""
        outs = []
        for j, (req, detok) in enumerate(zip(self.children, self.detokenizers, strict=True)):
            want = req.params.logprobs is not None
            outs.append(
                CompletionOutput(
                    index=j,
                    text="" if self.broken else detok.visible_text(req.finished),
                    token_ids=list(req.output_token_ids),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=list(req.output_logprobs) if want else None,
                    top_logprobs=list(req.output_top_logprobs) if want else None,
                )
            )
        errors = list(dict.fromkeys(c.error for c in self.children if c.error))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            metrics=self._metrics(),
            error="; ".join(errors) or None,
            num_cached_tokens=self.children[0].num_cached_tokens or 0,
            prompt_logprobs=_copy(self.children[0].prompt_logprobs),
        )

    def _metrics(self) -> RequestMetrics:
        """The samples' times together: the first token of any, the last of all."""
        children = self.children
        first_tokens = [c.metrics.first_token_time for c in children if c.metrics.first_token_time]
        last_tokens = [c.metrics.last_token_time for c in children if c.metrics.last_token_time]
        first = children[0].metrics
        finished_time = None
        if self.finished:
            finished_time = max(c.metrics.finished_time or 0.0 for c in children)
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min(first_tokens, default=None),
            last_token_time=max(last_tokens, default=None),
            finished_time=finished_time,
            num_preemptions=sum(c.metrics.num_preemptions for c in children),
        )


def _copy(entries: list | None) -> list | None:
    return None if entries is None else list(entries)
