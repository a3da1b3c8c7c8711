"""The benches' one timer: wall time on `time.perf_counter`, for a phase (`Stopwatch`,
`seconds`) and per call (`per_call_us`), and the 99th percentile of what it gave.

A child process a bench times in (a rank it starts with `python -c`) imports this module too:
its working directory is the repository root, as the bench's is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


class Stopwatch:
    """Wall seconds since it was made (or restarted): one phase of a bench, or several splits
    of one (a save's stall, then its completion)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def restart(self) -> None:
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def seconds(work: Callable[[], Any]) -> float:
    """Wall seconds of one call of `work`."""
    watch = Stopwatch()
    work()
    return watch.seconds()


def _nothing() -> None:
    pass


def _batch_s(call: Callable[[], Any], batch: int, settle: Callable[[], Any] | None) -> float:
    watch = Stopwatch()
    for _ in range(batch):
        call()
    if settle is not None:
        settle()
    return watch.seconds()


def per_call_us(
    call: Callable[[], Any],
    samples: int,
    batch: int = 1,
    *,
    settle: Callable[[], Any] | None = None,
    between: Callable[[], Any] | None = None,
    net_of_loop: bool = False,
) -> list[float]:
    """Microseconds per call: `samples` figures, each a batch of `batch` back-to-back calls
    timed together and divided by `batch` (batch 1: every call alone).

    `settle` runs inside each timed batch, after its calls (a CUDA synchronize: the calls are
    done when the device is); `between` runs after each batch, untimed (a pause that lets a
    server drain, as between training steps). `net_of_loop` takes off each batch the time of
    the same loop calling a function that does nothing, timed just before: for calls of tens
    of nanoseconds, the loop and the call itself would otherwise be much of the figure."""
    costs = []
    for _ in range(samples):
        empty = _batch_s(_nothing, batch, None) if net_of_loop else 0.0
        costs.append((_batch_s(call, batch, settle) - empty) / batch * 1e6)
        if between is not None:
            between()
    return costs


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
