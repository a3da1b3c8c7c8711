"""Straggler scores, as pure functions of section durations (no clock, no I/O).

- `summarise`: one interval's durations of one section on one rank -> median, count, total.
- `History`: per rank and section, the individual score: a reference taken from the rank's own
  last `length` interval medians / this interval's median. The reference is a low quantile of
  that window (not NVRx's best median ever: one lucky window would skew every later score), so
  a single fast or slow interval moves it little, and a lasting change of speed becomes the
  new reference once it fills most of the window (a slowdown is flagged for that long).
- `weighted`: a rank's "GPU" score, its sections' scores weighted by the time spent in each
  (NVRx weighs its kernels the same way).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple


class Summary(NamedTuple):
    """One section on one rank over one interval; times in nanoseconds."""

    median: float
    count: int
    total: float


def summarise(durations: Sequence[int]) -> Summary:
    """The median (the mean of the middle two for an even count), count and sum."""
    if not durations:
        raise ValueError("no durations to summarise")
    return Summary(float(statistics.median(durations)), len(durations), float(sum(durations)))


def weighted(scores: Mapping[str, float], totals: Mapping[str, float]) -> float:
    """The sections' scores weighted by the time spent in each; NaN without any."""
    weight = sum(totals[name] for name in scores)
    if not scores or weight <= 0:
        return math.nan
    return sum(score * totals[name] for name, score in scores.items()) / weight


def low_quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values`, rounded down to an observed value."""
    return sorted(values)[int(q * (len(values) - 1))]


@dataclasses.dataclass
class History:
    """Individual scores: each (rank, section, gpu) against its own last `length` intervals."""

    length: int = 16
    min_intervals: int = 1
    """Intervals seen before a rank gets an individual score (none before: no reference). One,
    so the second report has them, as NVRx's users expect (NVRx's reference includes the
    interval being scored, which makes its first score 1.0 and uninformative)."""
    quantile: float = 0.25
    _past: dict[tuple[int, str, bool], collections.deque[float]] = dataclasses.field(
        default_factory=dict
    )

    def score(self, rank: int, section: str, gpu: bool, median: float) -> float | None:
        """This interval's score (None while the history is short), then remember `median`."""
        past = self._past.get((rank, section, gpu))
        if past is None:  # not setdefault: a deque built per call, ranks x sections a report
            past = self._past[rank, section, gpu] = collections.deque(maxlen=self.length)
        score = None
        if len(past) >= self.min_intervals and median > 0:
            score = low_quantile(past, self.quantile) / median
        past.append(median)
        return score

    def forget(self) -> None:
        """A new cycle: ranks may be other processes on other nodes now."""
        self._past.clear()
