"""The engine loop: one thread owns the engine and steps it while work exists.

HTTP handlers run on the asyncio event loop and never touch the engine. They send commands
(add, abort, drain, stop) over a thread-safe queue; the thread answers on the event loop:
an add's outcome through a future, outputs through each request's `Submission` mailbox,
with one `call_soon_threadsafe` per step for all requests. Prompts arrive tokenized (on the
tokenizer thread, server/prompts.py): this thread only detokenizes outputs, with the
engine's own tokenizer.

Failures stay as small as they can: a request the engine fails (finish_reason "error") fails
for its client alone, and so does an error while routing one output. If an engine step
itself raises, every in-flight request fails (their state in that step is unknown) and the
engine is checked: if its device state and page accounting are intact the loop carries on
(a transient failure), but if they are not, or steps keep failing, the loop stops stepping
for good: /health answers 503 with the reason, new requests get 503, and the log says why.
The loop never dies silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxcb.engine.interface import Engine
from jaxcb.engine.lora_slots import LoRARequest
from jaxcb.sampling_params import SamplingParams
from jaxcb.server.metrics import ServerMetrics
from jaxcb.server.protocol import APIError, bad_request, param_of
from jaxcb.server.submission import EngineFailure, Route, Submission, TokenTexts, post_all, settle

logger = logging.getLogger(__name__)

STALL_WAIT_SECONDS = 0.01  # pause when waiting requests cannot be scheduled yet
SUBMIT_POLL_SECONDS = 1.0  # how often a waiting submit checks that the loop still runs
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine is declared broken


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = engine.config.limits.max_waiting_requests
        engine.record_steps()  # popped after every step, for per-step metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._routes: dict[str, Route] = {}
        self._token_text = TokenTexts(engine.tokenizer)  # for logprobs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="jaxcb-engine-loop", daemon=True)
        self._draining = False
        self._drain_deadline: float | None = None
        self._stopped = False
        self.error: BaseException | None = None  # why the loop died or stopped stepping
        self._step_failures = 0  # consecutive failed steps
        self._num_waiting = 0  # the engine's waiting sequences, as of the last gauge update
        # A list keeps every step's record as a step trace entry (serve.py --step-trace).
        self.steps: list[dict[str, Any]] | None = None

    # ---- called from the event loop (or any thread) --------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def failure_reason(self) -> str:
        """Why the loop is not alive (for /health and 503 answers)."""
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        return "the engine loop is not running"

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def drained(self) -> bool:
        """Draining, and nothing is left to finish (or the loop has ended)."""
        if not self._thread.is_alive():
            return True
        return self._drain_deadline is not None and not self._routes

    async def submit(
        self,
        submission: Submission,
        params: SamplingParams,
        *,
        arrival_time: float,
        priority: int = 0,
        param: str = "prompt",
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue the submission's prompts (`submission.prompt_token_ids`); raises APIError
        (400/429/503) if they were not accepted. `param`: the field an error names;
        `lora_request`: the LoRA adapter they run with."""
        if not self.alive:
            raise APIError(503, self.failure_reason, type="service_unavailable")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(
            lambda: self._add(
                submission, params, arrival_time, priority, param, future, lora_request
            )
        )
        try:
            # If the thread dies after the command was queued, nobody settles the future:
            # look up now and then rather than wait forever.
            while not future.done():
                await asyncio.wait({future}, timeout=SUBMIT_POLL_SECONDS)
                if not future.done() and not self._thread.is_alive():
                    future.cancel()
                    raise APIError(503, self.failure_reason, type="service_unavailable")
            future.result()
        except asyncio.CancelledError:
            self.abort(submission.request_ids)  # queued after the add, so it always lands
            raise

    async def call(self, fn: Callable[[], Any]) -> Any:
        """fn() run on the engine thread, between steps (what touches the engine outside a
        step: loading a LoRA adapter); its exception is raised here."""
        if not self.alive:
            raise APIError(503, self.failure_reason, type="service_unavailable")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # (handed to the caller, whatever it is)
                self._call_soon(_settle_with, future, None, exc)
            else:
                self._call_soon(_settle_with, future, result, None)

        self._commands.put(run)
        return await future

    def check_admission(self, num_prompts: int, n: int) -> None:
        """The APIError a request of `num_prompts` x `n` sequences would get now, if any: a
        check before its prompts are tokenized (the engine thread checks again on adding)."""
        self._check_admission(num_prompts, n, self._num_waiting)

    def _check_admission(self, num_prompts: int, n: int, waiting: int) -> None:
        """503 while the loop is broken or draining; 400 for a request that can never fit
        the waiting queue, 429 for one that does not fit now: a request's whole fan-out
        (prompts x n sequences) counts against max_waiting_requests."""
        if self.error is not None:
            raise APIError(503, self.failure_reason, type="service_unavailable")
        if self._draining or self._stopped:
            raise APIError(
                503, "the server is shutting down", type="service_unavailable", code="shutting_down"
            )
        limit, num_sequences = self.max_waiting_requests, num_prompts * n
        if num_sequences > limit:
            raise bad_request(
                f"this request asks for {num_sequences} sequences ({num_prompts} prompt"
                f"{'s' if num_prompts > 1 else ''} x n={n}), more than the server queues at once "
                f"(max_waiting_requests={limit})",
                "n" if n > 1 else "prompt",
            )
        if waiting + num_sequences > limit:
            raise APIError(
                429,
                f"too many requests are waiting ({waiting} sequences, and this request adds "
                f"{num_sequences}; the limit is {limit}); retry later",
                type="rate_limit_error",
                code="queue_full",
            )

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests and free their pages (non-blocking; unknown ids are ignored)."""
        ids = list(request_ids)
        self._commands.put(lambda: self._abort_ids(ids))

    def begin_drain(self, grace_seconds: float) -> None:
        """Stop admitting; abort what is still running after `grace_seconds`.

        Safe to call from a signal handler: it only sets a flag and puts on a SimpleQueue.
        """
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        self._commands.put(lambda: self._set_drain_deadline(deadline))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything left and end the thread (blocks until it has ended)."""
        self._commands.put(self._stop)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        failure: EngineFailure | None = None
        try:
            while not self._stopped:
                self._run_commands(wait=not self.engine.has_unfinished_requests())
                if self._stopped:
                    break
                deadline = self._drain_deadline
                if deadline is not None and self._routes and time.monotonic() >= deadline:
                    logger.warning(
                        "shutdown grace period is over: aborting %d requests", len(self._routes)
                    )
                    self._abort_ids(list(self._routes))
                stalled = False
                if self.error is None and self.engine.has_unfinished_requests():
                    stalled = not self._step()
                if stalled:  # nothing could be scheduled: wait a little for a command
                    self._run_commands(wait=True, timeout=STALL_WAIT_SECONDS)
        except BaseException as exc:
            logger.exception("the engine loop died")
            self.error = exc
            failure = EngineFailure(f"the engine loop died: {exc}")
        finally:
            if failure is not None:
                self._fail_all(failure)
            else:
                self._abort_ids(list(self._routes))
            self._update_gauges()
            self.engine.record_steps(False)

    def _run_commands(self, wait: bool, timeout: float | None = None) -> None:
        if self.error is not None:  # failed: nothing will step, so just wait for commands
            wait = True
        commands = []
        if wait:
            if self._drain_deadline is not None and self._routes:
                remaining = max(0.0, self._drain_deadline - time.monotonic())
                timeout = remaining if timeout is None else min(timeout, remaining)
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            command()

    def _step(self) -> bool:
        """One engine step; False if it had nothing it could schedule."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return True
        self._step_failures = 0
        records = self.engine.pop_step_records()  # one per step that ran
        if not records and not outputs:
            return False
        for record in records:
            self.metrics.step(record)
        if self.steps is not None:
            self.steps.extend(record.to_dict() for record in records)
        now = time.monotonic()
        batch = []
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            try:
                route.observe(out, now, self.metrics)
                if out.finished:
                    del self._routes[out.request_id]
                if out.finished or not route.submission.final_only:
                    route.attach_token_texts(out, self._token_text)
                    batch.append((route.submission, route.index, out))
            except Exception as exc:  # this request's problem only
                logger.exception("routing the output of %s failed", out.request_id)
                self._routes.pop(out.request_id, None)
                self._abort_quietly(out.request_id)
                batch.append((route.submission, route.index, EngineFailure(str(exc))))
        self._update_gauges()  # before delivering, so a client that sees its end sees them
        self._deliver(batch)
        return True

    def _step_failed(self, exc: Exception) -> None:
        """Fail every in-flight request, and keep going only if the engine is intact. The
        verdict comes first: a client that sees its request fail may ask /health at once."""
        self._step_failures += 1
        logger.error(
            "engine step failed; failing %d in-flight requests",
            len(self._routes),
            exc_info=exc,
        )
        try:
            self.engine.check_health()
            if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise RuntimeError(f"{self._step_failures} engine steps failed in a row")
        except Exception as broken:
            self.error = broken
            logger.critical(
                "the engine is broken (%s) after a failed step (%r): the server stops serving; "
                "/health answers 503. Restart it.",
                broken,
                exc,
            )
        self._fail_all(EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}"))
        self._update_gauges()

    # ---- commands --------------------------------------------------------------------------

    def _add(
        self,
        submission: Submission,
        params: SamplingParams,
        arrival_time: float,
        priority: int,
        param: str,
        future: asyncio.Future,
        lora_request: LoRARequest | None = None,
    ) -> None:
        try:
            self._admit(submission, params, arrival_time, priority, param, lora_request)
        except APIError as exc:
            self._call_soon(settle, future, exc)
            return
        except Exception as exc:
            logger.exception("adding request %s failed", submission.request_ids)
            self._call_soon(settle, future, APIError(500, str(exc), type="server_error"))
            return
        n = params.n
        for index, request_id in enumerate(submission.request_ids):
            self._routes[request_id] = Route.new(submission, index, arrival_time, n)
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in submission.prompt_token_ids))
        self._update_gauges()
        self._call_soon(settle, future, None)

    def _admit(
        self,
        submission: Submission,
        params: SamplingParams,
        arrival_time: float,
        priority: int,
        param: str,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate everything first, then add all prompts (or none) to the engine."""
        prompts = submission.prompt_token_ids
        self._check_admission(len(prompts), params.n, self.engine.num_waiting)
        added: list[str] = []
        try:
            for request_id, ids in zip(submission.request_ids, prompts, strict=True):
                self.engine.add_request(
                    request_id,
                    ids,
                    params,
                    arrival_time=arrival_time,
                    priority=priority,
                    lora_request=lora_request,
                )
                added.append(request_id)
        except ValueError as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
            message = str(exc)
            raise bad_request(message, param_of(message) or param) from None
        if lora_request is not None:
            self.metrics.lora_requests(lora_request.lora_name, len(prompts) * params.n)

    def _abort_ids(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        batch = []
        for request_id in request_ids:
            route = self._routes.pop(request_id, None)
            if route is None:
                continue  # finished already
            out = self.engine.abort_request(request_id)
            if out is not None:
                route.observe(out, now, self.metrics)
                route.attach_token_texts(out, self._token_text)
                batch.append((route.submission, route.index, out))
        self._update_gauges()
        self._deliver(batch)

    def _fail_all(self, failure: EngineFailure) -> None:
        batch = []
        for request_id, route in list(self._routes.items()):
            self._abort_quietly(request_id)
            batch.append((route.submission, route.index, failure))
        self._routes.clear()
        self._deliver(batch)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting %s failed", request_id)

    def _set_drain_deadline(self, deadline: float) -> None:
        self._draining = True
        self._drain_deadline = deadline
        logger.info(
            "draining: new requests get 503; %d in flight get %.1f s to finish",
            len(self._routes),
            max(0.0, deadline - time.monotonic()),
        )

    def _stop(self) -> None:
        self._stopped = True

    # ---- helpers ---------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        engine = self.engine
        self.metrics.num_requests_running.set(engine.num_running)
        self._num_waiting = engine.num_waiting
        self.metrics.num_requests_waiting.set(self._num_waiting)
        usage = engine.kv_usage()
        self.metrics.kv_cache_usage_perc.set(usage.usage)
        self.metrics.swap_pages_used.set(usage.num_swap_used)
        self.metrics.spec_decode(engine.spec_decode_counts())
        self.metrics.lora(*engine.lora_counts())

    def _deliver(self, batch: list[tuple[Submission, int, Any]]) -> None:
        if batch:
            self._call_soon(post_all, batch)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)


def _settle_with(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
