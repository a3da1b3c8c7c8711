"""Determinism statistics (`RerunMode.REPORT_DETERMINISM_STATS`): how far a step's re-run, in
place, strays from its first run, per validated result."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics

log = logging.getLogger("ftrun.rerun")

REPORTING_INTERVAL_ITERATIONS = 2
"""As Megatron-Core: log the spread every this many re-run iterations."""


@dataclasses.dataclass
class DeterminismStats:
    diffs: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    reruns: int = 0

    def record(self, message: str, diff: float) -> None:
        self.diffs.setdefault(message, []).append(diff)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per message: count, mean, max and the median relative difference."""
        out = {}
        for message, diffs in self.diffs.items():
            finite = [d for d in diffs if math.isfinite(d)]
            out[message] = {
                "count": float(len(diffs)),
                "mean": statistics.fmean(finite) if finite else math.inf,
                "median": statistics.median(finite) if finite else math.inf,
                "max": max(diffs) if diffs else 0.0,
            }
        return out

    def maybe_report(self, iteration: int) -> None:
        self.reruns += 1
        if self.reruns % REPORTING_INTERVAL_ITERATIONS:
            return
        for message, s in self.summary().items():
            log.warning("determinism at iteration %d, %r: %d re-runs, relative difference "
                        "mean %.3g, median %.3g, max %.3g", iteration, message, int(s["count"]),
                        s["mean"], s["median"], s["max"])  # fmt: skip
