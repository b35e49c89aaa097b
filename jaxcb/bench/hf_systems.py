"""The Hugging Face transformers systems of the offline benchmark, on one shared model.

`hf-cb` is transformers' own continuous batching (ContinuousBatchingManager); `hf-static` is
plain `model.generate` on padded batches, the baseline continuous batching exists to beat.
Both load the model through `BenchContext.hf_model()`, once for the two of them.
"""

from __future__ import annotations

import time
from typing import Any

from jaxcb.bench.base import BenchContext, PassResult, check_lengths, cut_at_stop
from jaxcb.bench.workloads import BenchRequest


class HFContinuousBatching:
    """transformers' ContinuousBatchingManager, one `add_request` per request with its own
    `max_new_tokens`. Each pass builds a fresh manager, serves a few warm-up requests through
    it (which also waits out its cache allocation), then times all requests in."""

    name = "hf-cb"

    def __init__(self, ctx: BenchContext) -> None:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.ctx, self.log = ctx, ctx.log
        self.requests, self.stops = ctx.workload.requests, ctx.workload.stops
        self.model = ctx.hf_model()
        self.warmup = self.requests[: max(1, min(ctx.warmup_requests, len(self.requests)))]
        self.hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in self.requests),
            max_generated_length=max(r.max_tokens for r in self.requests),
            num_requests=len(self.requests),
        )
        options = dict(ctx.hf_cb_options)
        page_size = options.setdefault("page_size", 256)
        # On CPU, transformers sizes the cache at 60% of RAM: far too greedy on a shared
        # machine. Room for every request at once instead, so nothing is ever offloaded.
        options.setdefault(
            "num_blocks",
            sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) for r in self.requests),
        )
        self.options = options
        self.resolved: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return dict(
            options=self.options,
            resolved_config=self.resolved,
            attn_implementation=self.model.config._attn_implementation,
        )

    def run_pass(self) -> PassResult:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        eos = list(self.stops) or -1  # -1: no EOS
        gen = GenerationConfig(do_sample=False, eos_token_id=eos, max_new_tokens=1)
        manager = self.model.init_continuous_batching(
            generation_config=gen,
            continuous_batching_config=ContinuousBatchingConfig(**self.options),
            workload_hints=self.hints,
        )
        manager.start()
        try:
            self._serve(manager, self.warmup, "warmup-")
            start = time.perf_counter()
            token_ids = self._serve(manager, self.requests, "", progress=True)
            wall = time.perf_counter() - start
            cfg = manager.continuous_batching_config
            self.resolved = {
                k: getattr(cfg, k)
                for k in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")
            }
        finally:
            manager.stop(block=True)
            manager.destroy()
        token_ids = [cut_at_stop(t, self.stops) for t in token_ids]
        check_lengths(self.name, token_ids, self.requests, self.stops)
        return PassResult(wall, token_ids)

    def _serve(self, manager, requests, prefix: str, progress: bool = False) -> list[list[int]]:
        for i, r in enumerate(requests):
            rid = manager.add_request(
                r.prompt_token_ids, request_id=f"{prefix}{i}", max_new_tokens=r.max_tokens
            )
            if rid is None:
                raise RuntimeError(f"{self.name}: the manager dropped request {i}")
        results: dict[str, list[int]] = {}
        last_log = time.perf_counter()
        while len(results) < len(requests):
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(
                        f"{self.name}: generation thread stopped with {len(results)} of "
                        f"{len(requests)} requests back"
                    )
                continue
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"{self.name}: request {out.request_id} failed: {out.error}")
                results[out.request_id] = list(out.generated_tokens)
            if progress and time.perf_counter() - last_log > 20:
                self.log(f"  {self.name}: {len(results)}/{len(requests)} requests back")
                last_log = time.perf_counter()
        return [results[f"{prefix}{i}"] for i in range(len(requests))]

    def close(self) -> None:
        self.model = None


class HFStaticBatching:
    """`model.generate` on left-padded batches in arrival order, each run for its longest
    request's `max_new_tokens`. Useful output is each request's own max_tokens; the rest
    (`raw_generated_tokens` minus useful) is the waste static batching pays."""

    name = "hf-static"

    def __init__(self, ctx: BenchContext) -> None:
        import torch

        self.torch, self.log = torch, ctx.log
        self.requests, self.stops = ctx.workload.requests, ctx.workload.stops
        self.batch_size = ctx.hf_static_batch_size
        self.model = ctx.hf_model()
        warm = self.requests[: max(1, min(ctx.warmup_requests, len(self.requests)))]
        self._generate(warm, max_new_tokens=4)

    def info(self) -> dict[str, Any]:
        return dict(
            batch_size=self.batch_size,
            attn_implementation=self.model.config._attn_implementation,
        )

    def _generate(self, batch: list[BenchRequest], max_new_tokens: int) -> list[list[int]]:
        from transformers import GenerationConfig

        torch = self.torch
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # pad id 0, masked out
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding: every row's last token at the end
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n :] = 1
        gen = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(self.stops) or None,
            pad_token_id=0,
        )
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, generation_config=gen)
        return out[:, width:].tolist()

    def run_pass(self) -> PassResult:
        token_ids: list[list[int]] = []
        raw = 0
        start = last_log = time.perf_counter()
        for b in range(0, len(self.requests), self.batch_size):
            batch = self.requests[b : b + self.batch_size]
            longest = max(r.max_tokens for r in batch)
            rows = self._generate(batch, longest)
            raw += sum(len(row) for row in rows)
            token_ids += [
                cut_at_stop(row[: r.max_tokens], self.stops)
                for row, r in zip(rows, batch, strict=True)
            ]
            if time.perf_counter() - last_log > 20:
                self.log(f"  {self.name}: {len(token_ids)}/{len(self.requests)} requests done")
                last_log = time.perf_counter()
        wall = time.perf_counter() - start
        check_lengths(self.name, token_ids, self.requests, self.stops)
        return PassResult(wall, token_ids, dict(raw_generated_tokens=raw))

    def close(self) -> None:
        self.model = None
