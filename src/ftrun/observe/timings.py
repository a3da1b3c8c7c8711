"""What a node's events tell over time that its `NodeView` does not keep: a pure fold.

`NodeTimings.apply(record)` takes the records `EventLog` writes, in order, like `NodeView`:

- `recoveries`: this node's own failures by the rung of the escalation ladder the policy chose
  for them (`tier`: the failure's `decision`, e.g. `restart`, `exclude node`, `stop job`) and
  their kind. A rung added later writes its own decision and is counted without a change here.
- `recovery`: seconds from the node's last progress before a failure stopped its workers to its
  ranks stepping again (`ftrun report`'s recovery, measured on the node's monotonic clock), or,
  for an in-process restart, from the fault to every rank ready again. A
  cycle that never trained keeps the earlier start: the failure before it is still being paid.
- `rendezvous`: the rounds' durations, joining to formed.

Durations are kept as histogram buckets (fixed bounds), so the metrics stay bounded however
long the job runs and Prometheus can aggregate them over nodes (`histogram_quantile`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from ftrun.eventlog.schema import NUM, has_type

RECOVERY_BOUNDS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
RENDEZVOUS_BOUNDS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
DEFAULT_TIER = "restart"
"""A failure event without a decision (written before the policy named it): a restart, as
`ftrun report` reads it."""
INPROCESS_TIER = "in-process"
"""Faults the wrapped ranks recovered without a cycle (`inprocess_recovered`; its `kind` is the
cause: EXCEPTION, UNRESPONSIVE, TERMINATED for a rank whose process was started again)."""


@dataclasses.dataclass
class Buckets:
    """A histogram's state: the count at or below each bound (not cumulative), and the sum."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), the last bound +Inf."""
        bounds = (*self.bounds, float("inf"))
        return list(zip(bounds, itertools.accumulate(self.counts), strict=True))


@dataclasses.dataclass
class NodeTimings:
    recoveries: collections.Counter[tuple[str, str]] = dataclasses.field(
        default_factory=collections.Counter
    )
    """This node's own failures by (tier, cause)."""
    recovery: Buckets = dataclasses.field(default_factory=lambda: Buckets(RECOVERY_BOUNDS))
    rendezvous: Buckets = dataclasses.field(default_factory=lambda: Buckets(RENDEZVOUS_BOUNDS))
    _lost_since: float | None = None
    """Monotonic: the last progress before the failure being recovered from (None: none)."""

    def apply(self, record: Mapping[str, Any]) -> None:
        kind = record.get("event")
        if kind == "rendezvous_done":
            if (duration := _number(record.get("duration"))) is not None:
                self.rendezvous.observe(max(duration, 0.0))
        elif kind == "failure":
            if not record.get("secondary"):
                tier = record.get("decision") or DEFAULT_TIER
                self.recoveries[(str(tier), str(record.get("kind")))] += 1
            self._lost_at(_number(record.get("mono")))
        elif kind == "last_progress" and record.get("before") == "stop":
            at = _number(record.get("progress_mono"))
            self._lost_at(at if at is not None else _number(record.get("mono")))
        elif kind == "restart":
            self._lost_at(_number(record.get("mono")))
        elif kind == "inprocess_recovered":  # the ladder's first rungs: no stop, no cycle
            self.recoveries[(INPROCESS_TIER, str(record.get("kind")))] += 1
            if (seconds := _number(record.get("seconds"))) is not None:
                self.recovery.observe(max(seconds, 0.0))
        elif kind == "stepping":
            self._stepped(_number(record.get("progress_mono")))
        elif kind == "exit":
            self._lost_since = None

    def _lost_at(self, at: float | None) -> None:
        if at is not None and (self._lost_since is None or at < self._lost_since):
            self._lost_since = at

    def _stepped(self, at: float | None) -> None:
        if self._lost_since is not None and at is not None:
            self.recovery.observe(max(at - self._lost_since, 0.0))
            self._lost_since = None


def _number(value: Any) -> float | None:
    return float(value) if has_type(value, NUM) else None
