"""torchrun's `--duplicate-stdout-filters` / `--duplicate-stderr-filters` for worker output.

torchrun 2.13 (`PContext` in torch/distributed/elastic/multiprocessing/api.py) appends every line
that contains any of the filter strings (plain substring, no pattern; an empty string matches every
line) to `filtered_stdout.log` / `filtered_stderr.log` in the attempt's log directory, one file per
stream shared by all local ranks, each line with the same rank prefix as on the console. It does so
for the lines it tails to the console (`--tee`, within `--local-ranks-filter`). ftrun relays every
stream itself, so it does so for every line that reaches the console: the teed ones and those never
redirected (torchrun cannot see those, they go straight to the terminal). The file is
`<log-dir>/<node>/cycle<N>/filtered_<stream>.log`.

Each relay thread opens the shared file with O_APPEND and writes each line with one `write`, so
lines of different ranks interleave whole, without a lock shared between the threads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("ftrun.agent")


def filtered_log(cycle_dir: Path, stream: str) -> Path:
    """Where one cycle's filtered copy of `stream` ("stdout" or "stderr") goes."""
    return cycle_dir / f"filtered_{stream}.log"


def matches(line: bytes, needles: Sequence[bytes]) -> bool:
    """torchrun's rule: the line contains any of the filters."""
    return any(needle in line for needle in needles)


class FilteredCopy:
    """Appends the matching lines of one worker stream, prefixed, to the shared filtered file.

    A context manager: the file is opened on entry, only when there is something to match (no
    filters or no path: every call does nothing). A write error switches the copy off; the
    relay to the console and the log file goes on.
    """

    def __init__(self, path: Path | None, filters: Sequence[str], prefix: bytes) -> None:
        self._path = path
        self._needles = tuple(f.encode() for f in filters) if path is not None else ()
        self._prefix = prefix
        self._fd: int | None = None

    def __enter__(self) -> FilteredCopy:
        if self._needles and self._path is not None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            try:
                self._fd = os.open(self._path, flags, 0o644)
            except OSError as e:  # as a failed write: the copy is off, the relay goes on
                log.warning("filtered output is not written to %s: %s", self._path, e.strerror)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def feed(self, line: bytes) -> None:
        """Copy `line` (as read, newline included) if it matches a filter."""
        if self._fd is None or not matches(line, self._needles):
            return
        data = self._prefix + (line if line.endswith(b"\n") else line + b"\n")
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            os.close(self._fd)
            self._fd = None


NOT_OPEN, GIVEN_UP = -2, -1
"""`append_log`'s descriptors that are no file: to open at the first call; failed, never again."""


def append_log(fd: int, path: Path, data: bytes) -> int:
    """Append `data` to the log file open as `fd` (`NOT_OPEN`: open it first); the fd to use
    next, `GIVEN_UP` once the file failed (one warning; nothing more is written to it)."""
    try:
        if fd == NOT_OPEN:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        while data and fd >= 0:
            data = data[os.write(fd, data) :]
    except OSError as e:
        log.warning("worker output is no longer written to %s: %s", path, e.strerror or e)
        if fd >= 0:
            os.close(fd)
        return GIVEN_UP
    return fd
