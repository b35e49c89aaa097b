"""Offline batch inference: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxcb.build import build_engine
from jaxcb.config import EngineConfig
from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.offline.driver import OfflineDriver
from jaxcb.offline.ordering import check_order
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """An engine for offline generation.

    `LLM()` runs the built-in tiny random-weight model; `LLM(path)` a Hugging Face model
    directory. `config` is an EngineConfig or a YAML preset path; any config field can also be
    given as a keyword (`LLM(path, max_num_seqs=64, page_size=16)`).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: EngineConfig | str | Path | None = None,
        **overrides: Any,
    ) -> None:
        if model is not None:
            overrides["model"] = str(model)
        if isinstance(config, EngineConfig):
            engine_config = config.replace(**overrides)
        elif config is not None:
            engine_config = EngineConfig.from_yaml(config, **overrides)
        else:
            engine_config = EngineConfig.from_dict(None, **overrides)
        self.engine = build_engine(engine_config)  # data_parallel_size > 1: replicas
        self.config = engine_config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        order: str = "arrival",
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string or a list of token ids. One SamplingParams applies to all
        prompts, or pass one per prompt. `priority`: one int per prompt, for the "priority"
        scheduling policy (lower first). Every prompt is validated before any is queued.

        `order` is when each request enters the engine (jaxcb/offline/ordering.py); it never
        changes a request's tokens or the order of the outputs. "arrival": all at once, in
        input order. "prefix": prompts that share a prefix of at least one KV page go in
        together, the longest shared prefixes closest, so the prefix is computed once and
        stays cached while its group runs. "auto": those groups, decode-heavy first (largest
        max_tokens per prompt token to compute), so long decodes share steps with the prefill
        of the rest. With "prefix" and "auto" the requests are fed through a window of
        max_num_seqs (times the replicas) waiting ones, and a request sharing pages with an
        earlier one waits until that one's prefill is done, so the two never both compute
        the shared pages in one step.

        `lora_request`: the LoRA adapter (engine started with enable_lora) to run every
        prompt with, or one per prompt (None: the base model).
        """
        check_order(order)
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        if priority is None:
            priorities = [0] * len(prompt_list)
        else:
            priorities = list(priority)
            if len(priorities) != len(prompt_list):
                raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts")
        engine = self.engine
        for lora in dict.fromkeys(x for x in loras if x is not None):
            engine.add_lora(lora)  # (each adapter read and checked before anything is queued)
        requests = list(zip(prompt_list, params_list, priorities, strict=True))
        prompt_ids = [
            engine.validate_request(prompt, params, priority=prio)[1]
            for prompt, params, prio in requests
        ]
        window = self.config.scheduler.max_num_seqs * self.config.parallel.data_parallel_size
        if order == "arrival":
            window = math.inf  # everything up front, as before orders existed
        ids: list[str | None] = [None] * len(requests)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0

        def submit(i: int, final_only: bool) -> str:
            prompt, sp, prio = requests[i]
            ids[i] = engine.add_request(
                None, prompt, sp, priority=prio, final_only=final_only, lora_request=loras[i]
            )
            return ids[i]

        def finished(out: RequestOutput) -> None:
            nonlocal generated
            results[out.request_id] = out
            generated += sum(len(o.token_ids) for o in out.outputs)
            if bar is not None:
                bar.update(1)
                rate = generated / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} out tok/s")

        driver = OfflineDriver(
            engine, has_room=lambda: engine.num_waiting < window, on_finished=finished
        )
        try:
            driver.submit_in_order(prompt_ids, params_list, order, submit)
            driver.drain()
        except BaseException:
            for request_id in ids:  # leave nothing behind on Ctrl-C or an error
                if request_id is not None:
                    engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        """Steps, bucket histogram, padding fraction, compile seconds, KV page use,
        preemptions, prefix cache queries / hits / hit rate (in tokens)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forget the cached pages of earlier requests (e.g. between benchmark passes)."""
        return self.engine.reset_prefix_cache()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    return list(prompts)
