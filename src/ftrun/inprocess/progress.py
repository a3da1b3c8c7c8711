"""`soft_timeout` and `hard_timeout`: a rank that stops calling `CallWrapper.ping()`.

As in NVRx, the timeouts apply once the function has pinged in the current iteration. Past
`soft_timeout` without a ping, this rank interrupts the iteration (every rank restarts, this
one too if its main thread can still be stopped); past `hard_timeout` the process is ended
(SIGTERM, then SIGKILL after `termination_grace_time`): its launcher restarts it. A main thread
that holds the GIL for good cannot be judged from inside its process; under `ft_launcher` the
rank monitor's heartbeat timeout judges it from outside.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftrun.inprocess.options import WrapperOptions


class ProgressWatchdog:
    """Judges this rank's pings on a thread of its own; `on_timeout(kind, why)` interrupts."""

    def __init__(self, options: WrapperOptions, on_timeout: Callable[[str, str], None]) -> None:
        self._soft = options.soft_timeout.total_seconds()
        self._hard = options.hard_timeout.total_seconds()
        self._grace = options.termination_grace_time.total_seconds()
        self._interval = min(options.progress_watchdog_interval.total_seconds(), self._soft / 4)
        self._on_timeout = on_timeout
        self._lock = threading.Lock()
        self._last_ping: float | None = None
        self._soft_fired = False
        self._paused = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def ping(self) -> None:
        with self._lock:
            self._last_ping = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftrun-inprocess-progress",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def start_iteration(self) -> None:
        with self._lock:
            self._last_ping, self._soft_fired = None, False

    stop_iteration = start_iteration

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last_ping = time.monotonic() if self._last_ping is not None else None

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self._interval + 1.0)  # none of it left running at exit

    def _run(self) -> None:
        while not self._closed.wait(self._interval):
            with self._lock:
                if self._last_ping is None or self._paused:
                    continue
                silent = time.monotonic() - self._last_ping
                fire_soft = silent > self._soft and not self._soft_fired
                self._soft_fired |= fire_soft
            if silent > self._hard:
                self._end_process(silent)
            elif fire_soft:
                self._on_timeout("SOFT_TIMEOUT", f"no progress for {silent:.1f}s")

    def _end_process(self, silent: float) -> None:
        os.write(2, f"ftrun.inprocess: no progress for {silent:.1f}s (hard_timeout): "
                    "ending this rank\n".encode())  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)
        if not self._closed.wait(self._grace):
            os.kill(os.getpid(), signal.SIGKILL)
