"""The agent's inbox: one queue for everything that happens to a node asynchronously.

Worker exits (from watcher threads), hang verdicts and progress notes (from the monitor thread)
and signals all arrive here; the agent's executor takes them one at a time. Signal handlers only
record: a `SimpleQueue.put` (reentrant, safe in a handler) and an attribute; they never raise,
log or lock. Torch-free: the CLI installs the handlers before the agent is imported.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import time
from collections.abc import Callable, Iterable


@dataclasses.dataclass(frozen=True)
class SignalReceived:
    signum: int


class SignalRecorder:
    """The handler for the launcher's signals: enqueue, remember the last one, nothing else."""

    def __init__(self, inbox: queue.SimpleQueue[object]) -> None:
        self.inbox = inbox
        self.last: int | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.last = signum
        self.inbox.put(SignalReceived(signum))

    def received(self) -> bool:
        """Whether any signal arrived (a wait for a restarting store gives up then)."""
        return self.last is not None

    def install(self, signals: Iterable[signal.Signals]) -> SignalRecorder:
        for sig in signals:
            signal.signal(sig, self)
        return self


def take_queued(inbox: queue.SimpleQueue[object], kind: type) -> list:
    """Remove and return queued items of `kind`, keeping the rest in order."""
    return take_until(inbox, kind, deadline=0.0)


def take_until(
    inbox: queue.SimpleQueue[object],
    kind: type,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
) -> list:
    """Remove and return the items of `kind` queued now or arriving before `deadline` (on
    `clock`), waiting on the inbox, never sleeping; every other item goes back, in order."""
    taken, kept = [], []
    while True:
        left = deadline - clock()
        try:
            item = inbox.get(timeout=left) if left > 0 else inbox.get_nowait()
        except queue.Empty:
            break
        (taken if isinstance(item, kind) else kept).append(item)
    for item in kept:
        inbox.put(item)
    return taken
