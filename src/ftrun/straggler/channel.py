"""Where a worker's detector talks to its node's agent: timings out, the latest report in.

Out: TIMINGS frames to the node's monitor (`FTRUN_MONITOR_ADDR`) through a
`rank_monitor.sender.MonitorSender` on a ZeroMQ context of the detector's own (a full queue
drops the batch and counts it: the training step never waits); first, one TIMINGS frame without
durations carries the settings `Detector.initialize` was given, which the agents may adopt
(`adopt`). In: the report the agents last
published, which the node's agent keeps in `<job dir>/straggler-report.json` (written
atomically); reading it is one `stat`, and a parse only when it changed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import zmq

from ftrun.config.monitor import ENV_RANK
from ftrun.environment import Env
from ftrun.owned_dir import replace_file
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.sender import MonitorSender
from ftrun.rank_monitor.timings import DetectorSettings, SectionTimes
from ftrun.straggler.recorder import Batch

REPORT_FILE = "straggler-report.json"
_CHUNK = 6000
"""Durations per frame: 6000 at up to 9 bytes each stay under the 64 KiB frame limit."""


def launcher_env() -> tuple[str, Path, int] | None:
    """(monitor address, job dir, rank) when running under ft_launcher, else None."""
    address, job_dir = os.environ.get(Env.MONITOR_ADDR), os.environ.get(Env.JOB_DIR)
    rank = os.environ.get(ENV_RANK)
    if not (address and job_dir and rank):
        return None
    return address, Path(job_dir), int(rank)


class MonitorChannel:
    """The sink of a detector under the launcher."""

    def __init__(self, address: str, rank: int) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self._ctx = zmq.Context()  # its own: `close` terms it, which flushes the last batch
        self._sender = MonitorSender(address, self._ctx)

    def announce(self, settings: DetectorSettings) -> None:
        """Tell the node's agent what this rank's detector was given (once, at initialize)."""
        self._sender.send(wire.Timings(self.rank, self.pid, (), settings))

    def take(self, batch: Batch) -> None:
        for chunk in _chunks(batch):
            self._sender.send(wire.Timings(self.rank, self.pid, chunk))

    def close(self) -> None:
        self._sender.close()
        self._ctx.term()


def _chunks(batch: Batch) -> list[tuple[SectionTimes, ...]]:
    frames: list[tuple[SectionTimes, ...]] = []
    current: list[SectionTimes] = []
    size = 0
    for name, gpu, durations in batch:
        for at in range(0, len(durations), _CHUNK):
            part = durations[at : at + _CHUNK]
            if size + len(part) > _CHUNK and current:
                frames.append(tuple(current))
                current, size = [], 0
            current.append(SectionTimes(name, gpu, tuple(part)))
            size += len(part)
    if current:
        frames.append(tuple(current))
    return frames


class ReportFile:
    """The latest report the node's agent wrote; re-read only when the file changed."""

    def __init__(self, job_dir: Path) -> None:
        self.path = job_dir / REPORT_FILE
        self._mark: tuple[int, int] | None = None
        self.latest: dict[str, Any] | None = None

    def refresh(self) -> bool:
        """Re-read the file if it changed; True if a new report was read."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        mark = (stat.st_mtime_ns, stat.st_ino)
        if mark == self._mark:
            return False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False  # being replaced right now: the next call reads the new one
        self._mark = mark
        self.latest = data
        return True


def write_report(job_dir: Path, data: dict[str, Any]) -> None:
    """Atomically replace the node's report file (the agent's side of `ReportFile`)."""
    replace_file(job_dir / REPORT_FILE, json.dumps(data))
