"""Programs compiled on a background thread, after the engine is ready: the server answers
once its smallest bucket is compiled, and the rest compile while it serves.

A `CompileQueue` takes keys (a bucket's step, a sequence-row count's sampling program) and a
function that compiles one; one thread compiles them in order. `wait(key)` is what a step
calls for a program not compiled yet: the key moves to the front of the queue and the
caller waits for it (a compile error is raised there, in the step that needed the program).
Nothing is compiled twice and nothing after the queue is empty, so the no-recompile rule
holds: the queue only moves start-up's compiles past the moment the engine is ready.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

_RUNNING: weakref.WeakSet[CompileQueue] = weakref.WeakSet()


class CompileQueue:
    """`compile_one(key)` for each key, in order, on one daemon thread."""

    def __init__(self, keys: Sequence[Hashable], compile_one: Callable[[Any], Any]) -> None:
        self._order = list(keys)
        self._futures: dict[Hashable, Future] = {key: Future() for key in keys}
        self._compile_one: Callable[[Any], Any] | None = compile_one
        self._lock = threading.Lock()
        self._stopped = False
        self.seconds = 0.0  # wall time of the compiles done so far
        self._thread = threading.Thread(target=self._run, name="jaxcb-compile", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._futures

    @property
    def pending(self) -> int:
        """Programs not compiled yet (0: the queue is done)."""
        return sum(not f.done() for f in self._futures.values())

    def done(self, key: Hashable) -> bool:
        return self._futures[key].done()

    def prioritize(self, key: Hashable) -> None:
        """Compile the key next, if it has not started yet."""
        with self._lock:
            if key in self._order:
                self._order.remove(key)
                self._order.insert(0, key)

    def wait(self, key: Hashable) -> Any:
        """The key's program, prioritized and waited for; its compile's exception is
        raised here."""
        self.prioritize(key)
        return self._futures[key].result()

    def stop(self, timeout: float | None = None) -> None:
        """Compile nothing more (the program being compiled is finished first)."""
        with self._lock:
            self._stopped = True
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped or not self._order:
                    break
                key = self._order.pop(0)
            t0 = time.perf_counter()
            try:
                program = self._compile_one(key)
            except BaseException as exc:  # raised again in the step that waits for it
                logger.error("compiling %s in the background failed: %s", key, exc)
                self._futures[key].set_exception(exc)
                continue
            finally:
                self.seconds += time.perf_counter() - t0
            self._futures[key].set_result(program)
        if not self._stopped:
            logger.info(
                "compiled %d programs in the background in %.1fs", len(self._futures), self.seconds
            )
        for future in self._futures.values():  # stopped: nothing waits forever
            if not future.done():
                future.set_exception(RuntimeError("the background compile was stopped"))
        self._compile_one = None  # (it holds the runner, params and KV pool)


@atexit.register
def _stop_all() -> None:
    """At exit, stop every queue after its current program: a daemon thread inside XLA's
    compiler while the interpreter shuts down can crash the process on its way out."""
    for queue in list(_RUNNING):
        queue.stop(timeout=30)
