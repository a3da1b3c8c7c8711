"""NVRx's `Statistic`: the keys of a section's local timing summary."""

from __future__ import annotations

import enum


class Statistic(enum.Enum):
    """A summary statistic of a section's durations (milliseconds, except NUM)."""

    MIN = enum.auto()
    MAX = enum.auto()
    MED = enum.auto()
    AVG = enum.auto()
    STD = enum.auto()
    NUM = enum.auto()

    def __str__(self) -> str:
        return self.name
