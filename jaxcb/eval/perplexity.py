"""Perplexity of a text through the engine's prompt logprobs, over sliding windows.

The recipe of Hugging Face's perplexity guide ("Perplexity of fixed-length models"): windows
of `max_length` tokens start every `stride` tokens, and each window scores only the tokens
the previous one did not (those past its end), with the window's tokens before them as
context. A window's first token has no context and is never scored, so the text's first
token never is, nor (with stride == max_length) the first token of any window. Mean NLL =
the sum of the scored tokens' negative logprobs over their number (the guide weights each
window's mean by its token count less one, which undercounts a window after the first by a
token; the sum here is exact), perplexity = exp(mean NLL).

Each window is one request (`prompt_logprobs=0`, `max_tokens=1`): the engine scores its
prompt in its own prefill steps, many windows in flight at once, chunked and batched like
any other request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from jaxcb.engine.interface import Engine
from jaxcb.offline.driver import OfflineDriver
from jaxcb.outputs import RequestOutput
from jaxcb.sampling_params import SamplingParams

WINDOW_PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)


@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window (in the text's token ids)
    end: int  # one past its last
    first_scored: int  # the tokens first_scored .. end - 1 are its to score

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


def sliding_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The guide's windows over `num_tokens` tokens (ValueError for impossible sizes)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (context and a token), got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s): nothing to score")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return [w for w in windows if w.num_scored > 0]


@dataclass(frozen=True)
class PerplexityResult:
    num_tokens: int  # tokens in the text
    num_scored: int  # tokens scored (all but the first of the text, and of windows on a stride)
    num_windows: int
    window_tokens: int  # tokens the engine ran: the windows overlap by max_length - stride
    nll_sum: float
    seconds: float
    max_length: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def tokens_per_second(self) -> float:
        """Scored tokens per second."""
        return self.num_scored / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_nll": self.mean_nll,
            "perplexity": self.perplexity,
            "tokens_per_second": self.tokens_per_second,
        }


def perplexity(
    engine: Engine,
    token_ids: Sequence[int],
    *,
    max_length: int,
    stride: int,
    max_in_flight: int | None = None,
    on_window: Callable[[int, float], None] | None = None,
) -> PerplexityResult:
    """The text's perplexity under the engine's model. `max_in_flight`: windows in the
    engine at once (default: 2 x max_num_seqs); `on_window(tokens scored, their NLL)` after
    each window (a progress bar). Every request is aborted if anything goes wrong."""
    if max_length > engine.max_model_len:
        raise ValueError(
            f"max_length={max_length} is longer than the engine's max_model_len="
            f"{engine.max_model_len}: lower it, or raise --max-model-len"
        )
    windows = sliding_windows(len(token_ids), max_length, stride)
    if max_in_flight is None:
        config = engine.config
        max_in_flight = 2 * config.scheduler.max_num_seqs * config.parallel.data_parallel_size
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    ids = list(token_ids)
    prompts = [ids[w.begin : w.end] for w in windows]
    in_flight: dict[str, Window] = {}
    nll_sum, start = 0.0, time.perf_counter()

    def submit(index: int, final_only: bool) -> str:
        request_id = f"ppl-{index}"
        engine.add_request(request_id, prompts[index], WINDOW_PARAMS, final_only=True)
        in_flight[request_id] = windows[index]
        return request_id

    def finished(out: RequestOutput) -> None:
        nonlocal nll_sum
        window = in_flight.pop(out.request_id)
        nll = _window_nll(out, ids, window)
        nll_sum += nll
        if on_window is not None:
            on_window(window.num_scored, nll)

    driver = OfflineDriver(
        engine, has_room=lambda: len(in_flight) < max_in_flight, on_finished=finished
    )
    try:
        driver.submit_in_order(prompts, [WINDOW_PARAMS] * len(prompts), "arrival", submit)
        driver.drain()
    except BaseException:
        for request_id in in_flight:
            engine.abort_request(request_id)
        raise
    return PerplexityResult(
        num_tokens=len(ids),
        num_scored=sum(w.num_scored for w in windows),
        num_windows=len(windows),
        window_tokens=sum(w.end - w.begin for w in windows),
        nll_sum=nll_sum,
        seconds=time.perf_counter() - start,
        max_length=max_length,
        stride=stride,
    )


def _window_nll(out: RequestOutput, ids: list[int], window: Window) -> float:
    """The summed NLL of the tokens the window scores (entry i of its prompt logprobs is
    window token i's logprob given those before it)."""
    if out.error is not None or out.prompt_logprobs is None:
        raise RuntimeError(f"the window at token {window.begin} failed: {out.error}")
    entries = out.prompt_logprobs
    return -math.fsum(
        entries[t - window.begin][ids[t]] for t in range(window.first_scored, window.end)
    )
