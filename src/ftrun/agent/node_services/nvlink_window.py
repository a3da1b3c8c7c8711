"""NVLink error counters over a window: NVRx 0.7's `NVLinkWindowHealthCheck`, as a pure rule.

NVRx (`shared_utils/health_check.py`) reads each NVLink's error counters (`nvml.nvlink_errors`)
once a minute. A reading is a *window*, flagged when any of the link's counters rose since the
link's previous reading (a link's first reading only sets its baseline; counters that went down,
a reset, set a new one). A link is bad when more than 15 of the last 30 windows were flagged,
and a GPU with a bad link is unhealthy. One burst of errors is one window: noise; errors in more
than half the minutes of half an hour are a failing link.

The health watch reads every `--ft-health-interval` (5 s), more often than NVRx, so a window
here is `window_s` (60 s) of monotonic time, not a reading: every reading within it flags the
same window, and the last 30 windows are the last 30 minutes whatever the interval. Pure: the
time comes in with each reading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

WINDOW_S = 60.0
"""NVRx's interval between readings: the span of one window."""
WINDOWS = 30
"""NVRx's window_count: how many of the latest windows count."""
THRESHOLD = 15
"""NVRx's threshold: a link with more flagged windows than this is bad."""

Link = tuple[int, int]
"""(NVML index of the GPU, link number)."""


@dataclasses.dataclass
class LinkWindows:
    """Each link's baseline and flagged windows, fed one reading at a time."""

    window_s: float = WINDOW_S
    windows: int = WINDOWS
    threshold: int = THRESHOLD
    _last: dict[Link, dict[int, int]] = dataclasses.field(default_factory=dict)
    _flagged: dict[Link, set[int]] = dataclasses.field(default_factory=dict)

    def add(self, now: float, link: Link, counters: Mapping[int, int]) -> int:
        """Record a reading of `link`'s counters at `now` (monotonic seconds); returns how many
        of the latest `windows` windows are flagged."""
        last = self._last.setdefault(link, {})
        rose = any(key in last and value > last[key] for key, value in counters.items())
        last.update(counters)
        window = int(now // self.window_s)
        flagged = {w for w in self._flagged.get(link, ()) if w > window - self.windows}
        if rose:
            flagged.add(window)
        self._flagged[link] = flagged
        return len(flagged)

    def bad(self, flagged: int) -> bool:
        return flagged > self.threshold
