"""Stopping the main thread's training function from another thread, as NVRx does.

When another rank fails, this rank's main thread is somewhere in the wrapped function: in Python
code, in a collective (blocked in C++ until its process group is aborted), or sleeping. The
watcher aborts the process groups first (that returns a blocked collective with an error) and
then raises `RankShouldRestart` in the main thread. It is raised by a signal handler, not only by
`PyThreadState_SetAsyncExc`: an asynchronous exception waits for the next bytecode, so a main
thread in `time.sleep` or a blocking read would only see it when that call returns; a signal
makes the call return (EINTR) and its handler raises at once.

`RankShouldRestart` is a `BaseException`, so a user's `except Exception` does not swallow it.
The `atomic()` sections of `CallWrapper` hold `Interrupter.lock`: the watcher never interrupts
in the middle of one (a checkpoint being written), and the main thread never enters one once
a restart has begun.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator

INTERRUPT_SIGNAL = signal.SIGRTMIN + 5
"""A real-time signal nobody else sends (SIGUSR1 is Lightning's requeue signal on Slurm, and
SIGUSR2 ftrun's own stack-dump signal)."""


class RankShouldRestart(BaseException):
    """Raised in the main thread: this restart iteration is over, the wrapper restarts it."""


class Interrupter:
    """Raises `RankShouldRestart` in the thread that made it (the wrapper's caller), and only
    while that thread runs the user's function (`user_code()`): never inside the wrapper's own
    bookkeeping, where an exception at an arbitrary bytecode would lose a lock or a record."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._thread = threading.current_thread()
        self._armed = False
        self._pending = False
        self._in_user_code = False
        self._previous: object = None
        self._by_signal = self._thread is threading.main_thread()
        if self._by_signal:
            self._previous = signal.signal(INTERRUPT_SIGNAL, self._on_signal)

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        """A new iteration starts: it may be interrupted from now on. A fresh lock: one that an
        interrupt raised right after `atomic()` took it (before its `try`) left held must not
        block the next iteration's watcher."""
        self.lock = threading.RLock()
        self._pending = False
        self._armed = True

    def disarm(self) -> bool:
        """The main thread is done with the function (returned, raised, or was interrupted): no
        interrupt after this returns; waits for one in progress (its abort). True if one had
        been sent and not raised: the caller restarts as if it had been."""
        with self.lock:
            self._armed = False
            pending, self._pending = self._pending, False
            return pending

    @contextlib.contextmanager
    def user_code(self) -> Iterator[None]:
        """The main thread runs the user's function: an interrupt raises here."""
        if self._pending:
            raise RankShouldRestart("interrupted before the function started")
        self._in_user_code = True
        try:
            yield
        finally:
            self._in_user_code = False

    def interrupt(self) -> bool:
        """Stop the main thread's function; False if it had already left it (call it with
        `lock` held: see `Watcher`)."""
        with self.lock:
            if not self._armed:
                return False
            self._armed = False
            self._pending = True
        if self._by_signal:
            signal.pthread_kill(self._thread.ident, INTERRUPT_SIGNAL)
        elif self._in_user_code:  # a wrapper called off the main thread: no handler runs there
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread.ident), ctypes.py_object(RankShouldRestart)
            )
        return True

    def close(self) -> None:
        self.disarm()
        if self._by_signal:
            signal.signal(INTERRUPT_SIGNAL, self._previous or signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: object) -> None:
        # No lock here: the handler runs between two bytecodes of whatever the main thread does.
        if self._pending and self._in_user_code:
            self._pending = False
            raise RankShouldRestart("another rank failed: this iteration restarts")
