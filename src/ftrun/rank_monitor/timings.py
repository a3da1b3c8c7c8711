"""Section timings that ranks ship to their node's monitor (for `ftrun.straggler`).

A rank's straggler detector sends its section durations in batches, fire-and-forget, as TIMINGS
frames on a DEALER socket of its own (the rank's `RankMonitorClient`, if any, keeps its
registration: a second HELLO would replace it); once, at `Detector.initialize`, a TIMINGS frame
without durations carries the settings it was given (`DetectorSettings`). A batch carries the
rank and the sending pid, and the server checks them the way it checks a HELLO (the pid must be
the spawned worker or a descendant), once per connection. The owner receives `TimingBatch`es
through the server's `on_timings` callback, off the lock, and must only enqueue them: statistics
run elsewhere.

Torch-free and psutil-free: the in-worker detector imports this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ftrun.errors import ProtocolError

MAX_DURATION_NS = 2**53
"""A duration above this (104 days) is malformed."""
MAX_BATCH_SECTIONS = 256
MAX_REPORT_INTERVAL_S = 7 * 24 * 3600.0
"""A report interval above a week is malformed."""
MAX_NODE_NAME_LEN = 255


@dataclasses.dataclass(frozen=True)
class SectionTimes:
    """Durations of one section in nanoseconds, CPU wall time or (`gpu`) CUDA event time."""

    name: str
    gpu: bool
    durations: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DetectorSettings:
    """What a rank's `Detector.initialize` was given that its agent may adopt (NVRx's names)."""

    report_time_interval: float
    node_name: str | None = None

    def to_wire(self) -> list[Any]:
        return [self.report_time_interval, self.node_name]


@dataclasses.dataclass(frozen=True)
class TimingBatch:
    """A verified rank's batch, as the server hands it to its owner."""

    rank: int
    worker_pid: int
    """The pid the owner registered with `expect_rank` (as in `Verdict`)."""
    sections: tuple[SectionTimes, ...]
    at: float
    """The server's monotonic clock when the batch arrived."""
    settings: DetectorSettings | None = None
    """The rank's detector settings (a batch sent by `Detector.initialize`, no durations)."""


def parse_sections(raw: object, name_of: Callable[[object], str]) -> tuple[SectionTimes, ...]:
    """The wire form `[[name, gpu, [ns, ...]], ...]`, validated; `ProtocolError` if malformed."""
    if not isinstance(raw, list) or len(raw) > MAX_BATCH_SECTIONS:
        raise ProtocolError(f"timings must be a list of at most {MAX_BATCH_SECTIONS} sections")
    return tuple(_section(entry, name_of) for entry in raw)


def parse_settings(raw: object) -> DetectorSettings:
    """The wire form `[report_time_interval, node_name or nil]`, validated."""
    if not isinstance(raw, list) or len(raw) != 2:
        raise ProtocolError("detector settings must be [report_time_interval, node_name]")
    interval, node_name = raw
    if (
        type(interval) not in (int, float)
        or not math.isfinite(interval)
        or not 0 < interval <= MAX_REPORT_INTERVAL_S
    ):
        raise ProtocolError(f"report_time_interval must be in (0, {MAX_REPORT_INTERVAL_S:g}] s")
    if node_name is not None and not (
        isinstance(node_name, str)
        and 0 < len(node_name) <= MAX_NODE_NAME_LEN
        and node_name.isprintable()
    ):
        raise ProtocolError(f"node_name must be nil or 1..{MAX_NODE_NAME_LEN} printable characters")
    return DetectorSettings(float(interval), node_name)


def _section(entry: Any, name_of: Callable[[object], str]) -> SectionTimes:
    if not isinstance(entry, list) or len(entry) != 3:
        raise ProtocolError("a timings entry must be [name, gpu, durations]")
    name, gpu, durations = entry
    if type(gpu) is not bool or not isinstance(durations, list):
        raise ProtocolError("a timings entry must be [name, gpu, durations]")
    for value in durations:
        if type(value) is not int or not 0 <= value <= MAX_DURATION_NS:
            raise ProtocolError(f"a duration must be an integer in [0, {MAX_DURATION_NS}] ns")
    return SectionTimes(name_of(name), gpu, tuple(durations))


class TimingSenders:
    """Which connections may send timings, and as which rank (checked once per connection)."""

    def __init__(self, is_descendant: Callable[[int, int], bool]) -> None:
        self._is_descendant = is_descendant
        self._verified: dict[bytes, tuple[int, int, int]] = {}  # identity -> rank, pid, spawned

    def spawned_pid(self, identity: bytes, rank: int, pid: int, expected: int | None) -> int | None:
        """The spawned worker's pid if `pid` may report for `rank`; None if not."""
        known = self._verified.get(identity)
        if known is not None and known[:2] == (rank, pid) and known[2] == expected:
            return expected
        if expected is None or not self._is_descendant(pid, expected):
            return None
        self._verified[identity] = (rank, pid, expected)
        return expected

    def clear(self) -> None:
        self._verified.clear()
