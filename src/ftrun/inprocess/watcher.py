"""The thread that waits for the current iteration's end and stops the main thread early.

One per wrapped call, with its own store connection (a blocking wait holds its connection). It
blocks on the iteration's `end` key; if the iteration was interrupted while the main thread
still runs the function, it aborts the process groups (a collective blocked on a dead peer
returns) and raises `RankShouldRestart` in the main thread, never inside an `atomic()` section.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ftrun.inprocess.interrupt import Interrupter
from ftrun.inprocess_protocol import Iteration

log = logging.getLogger("ftrun.inprocess")

_CLOSE_BOUND_S = 10.0
"""How long closing waits for the thread's last store call (the iteration's `end` is set by
then, so that call returns at once unless the store is gone, when it fails about as fast)."""


class Watcher:
    """Watches iteration after iteration, as `follow` hands them over."""

    def __init__(self, interrupter: Interrupter, abort: Callable[[], None],
                 entered: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """`entered(number)`: called on this thread each time it starts watching iteration
        `number`, while the main thread runs the function (the wrapper forgets old keys)."""
        self._interrupter = interrupter
        self._abort = abort
        self._entered = entered
        self._changed = threading.Condition()
        self._iteration: Iteration | None = None
        self._closed = False
        self.aborted = threading.Event()
        """Set once this watcher aborted the process groups of the current iteration."""
        self.abort_error: BaseException | None = None
        self.timings: dict[str, float] = {}
        """When this watcher saw the iteration end (`seen`, wall clock), how long its abort took
        (`abort_s`), and when it signalled the main thread (`signalled`, monotonic)."""
        self._thread = threading.Thread(target=self._run, name="ftrun-inprocess-watcher",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def follow(self, iteration: Iteration) -> None:
        """Watch `iteration` (on the watcher's own store connection) from now on."""
        with self._changed:
            self.aborted.clear()
            self.abort_error = None
            self.timings = {}
            self._iteration = iteration
            self._changed.notify_all()

    def close(self, timeout_s: float = _CLOSE_BOUND_S) -> None:
        """Stop watching and wait (bounded) for the thread to end. A daemon thread still in a
        store call when the interpreter finalizes aborts the process: it returns from the call,
        cannot take the GIL back, and is unwound through torch's noexcept frames (SIGABRT,
        "terminate called without an active exception", after training had finished)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("in-process watcher: still in a store call %gs after the wrapped "
                            "call ended", timeout_s)  # fmt: skip

    def _next(self, done: Iteration | None) -> Iteration | None:
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._iteration is not done)
            return None if self._closed else self._iteration

    def _run(self) -> None:
        iteration: Iteration | None = None
        while (iteration := self._next(iteration)) is not None:
            self._tidy(iteration.number)
            try:
                while not iteration.wait_end():
                    if self._closed or self._iteration is not iteration:
                        break
                else:
                    seen = time.time()
                    if iteration.was_interrupted():
                        self._stop_main_thread(iteration, seen)
            except Exception as error:  # the store is gone: the main thread finds out itself
                log.debug("in-process watcher: %s", error)
                if self._closed:
                    return

    def _tidy(self, number: int) -> None:
        """`entered(number)`, never at the cost of the watch: a failure is logged and left."""
        if self._entered is None:
            return
        try:
            self._entered(number)
        except Exception as error:  # the store is gone: the watch finds out and says so
            log.debug("in-process watcher: forgetting old keys: %s", error)

    def _stop_main_thread(self, ended: Iteration, seen: float) -> None:
        with self._interrupter.lock:  # never inside the main thread's atomic() section
            # `ended` may be one the main thread has left already (this thread saw its end
            # late, under load): the main thread follows the next one before it arms, so an
            # armed interrupter with another iteration followed is the next one's, running.
            if not self._interrupter.armed or self._iteration is not ended:
                return
            started = time.monotonic()
            try:
                self._abort()
            except BaseException as error:
                self.abort_error = error
            self.aborted.set()
            now = time.monotonic()
            self.timings = {"seen": seen, "abort_s": now - started, "signalled": now}
            self._interrupter.interrupt()
