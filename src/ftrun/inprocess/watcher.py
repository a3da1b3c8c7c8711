"""The thread that waits for the current iteration's end and stops the main thread early.

One per wrapped call, with its own store connection (a blocking wait holds its connection). It
blocks on the iteration's `end` key; if the iteration was interrupted while the main thread
still runs the function, it aborts the process groups (a collective blocked on a dead peer
returns) and raises `RankShouldRestart` in the main thread, never inside an `atomic()` section.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ftrun.inprocess.interrupt import Interrupter
from ftrun.inprocess.iteration import Iteration

log = logging.getLogger("ftrun.inprocess")


class Watcher:
    """Watches iteration after iteration, as `follow` hands them over."""

    def __init__(self, interrupter: Interrupter, abort: Callable[[], None]) -> None:
        self._interrupter = interrupter
        self._abort = abort
        self._changed = threading.Condition()
        self._iteration: Iteration | None = None
        self._closed = False
        self.aborted = threading.Event()
        """Set once this watcher aborted the process groups of the current iteration."""
        self.abort_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ftrun-inprocess-watcher",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def follow(self, iteration: Iteration) -> None:
        """Watch `iteration` (on the watcher's own store connection) from now on."""
        with self._changed:
            self.aborted.clear()
            self.abort_error = None
            self._iteration = iteration
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _next(self, done: Iteration | None) -> Iteration | None:
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._iteration is not done)
            return None if self._closed else self._iteration

    def _run(self) -> None:
        iteration: Iteration | None = None
        while (iteration := self._next(iteration)) is not None:
            try:
                while not iteration.wait_end():
                    if self._closed or self._iteration is not iteration:
                        break
                else:
                    if iteration.was_interrupted():
                        self._stop_main_thread()
            except Exception as error:  # the store is gone: the main thread finds out itself
                log.debug("in-process watcher: %s", error)
                if self._closed:
                    return

    def _stop_main_thread(self) -> None:
        with self._interrupter.lock:  # never inside the main thread's atomic() section
            if not self._interrupter.armed:
                return
            try:
                self._abort()
            except BaseException as error:
                self.abort_error = error
            self.aborted.set()
            self._interrupter.interrupt()
