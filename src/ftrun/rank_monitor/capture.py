"""Stack capture off the monitor thread: a hung rank's stacks are taken, then its verdict posted.

Capturing waits (up to `stack_capture_timeout`) for the rank's faulthandler to write; the
monitor thread must not wait with it, or every other rank's deadline would wait too. Each batch
of ranks found hung at once is captured by its own short-lived thread, so a slow capture
delays only its own verdicts. `close` joins them, bounded.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ftrun.rank_monitor import stacks

log = logging.getLogger("ftrun.rank_monitor")

Capture = Callable[[list[tuple[int, Path]], signal.Signals, float], dict[Path, str]]
"""(pid, stack file) targets, the signal, the timeout -> each file's new text ("" if none)."""


def capture_stacks(
    targets: list[tuple[int, Path]], sig: signal.Signals, timeout: float
) -> dict[Path, str]:
    """The real capture: signal every target, then read what each appended (bounded)."""
    return stacks.collect_dumps(stacks.request_dumps(targets, sig), timeout)


class StackCapturer:
    """Runs captures in threads of their own and hands each result to its callback."""

    def __init__(self, capture: Capture, sig: signal.Signals, timeout: float) -> None:
        self._capture, self._sig, self._timeout = capture, sig, timeout
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def submit(
        self, targets: list[tuple[int, Path]], then: Callable[[dict[Path, str]], None]
    ) -> None:
        """Capture `targets` in a new thread, then call `then(dumps)` in it."""
        thread = threading.Thread(
            target=self._run, args=(targets, then), name="rank-monitor-stacks", daemon=True
        )
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def close(self, extra: float = 1.0) -> None:
        """Wait (at most the capture timeout plus `extra`) for the captures under way."""
        deadline = time.monotonic() + self._timeout + extra
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(
        self, targets: list[tuple[int, Path]], then: Callable[[dict[Path, str]], None]
    ) -> None:
        try:
            try:
                dumps = self._capture(targets, self._sig, self._timeout)
            except Exception as exc:  # a verdict without stacks beats no verdict
                log.warning("could not capture the stacks of %s: %s", [p for p, _ in targets], exc)
                dumps = {path: "" for _, path in targets}
            then(dumps)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
