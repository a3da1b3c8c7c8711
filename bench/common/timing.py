"""Per-call timing for the benches that time one call many times (microseconds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def timed(call: Callable[[], Any], count: int) -> list[float]:
    """Microseconds per call, `count` calls."""
    costs = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        costs.append((time.perf_counter() - start) * 1e6)
    return costs


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
