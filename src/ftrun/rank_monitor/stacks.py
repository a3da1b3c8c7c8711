"""Capturing a hung rank's Python stacks through the faulthandler the client registered.

faulthandler's handler is C code that needs no GIL, so it dumps even when the rank is stuck in a
collective or a C extension. The dump goes to a file the server names (never the client), and
the server reads only what was appended after it sent the signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import time
from pathlib import Path
from typing import NamedTuple

_SETTLE_S = 0.005
_POLL_S = 0.002
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# Interpreter, installed packages and ftrun itself; anything else is the user's code.
_PACKAGES = re.compile(r"/(?:site|dist)-packages/")
_STDLIB = re.compile(r"/lib/python3\.\d+/")
_LIBRARY = re.compile(rf"^<|{_PACKAGES.pattern}|{_STDLIB.pattern}")
_FTRUN_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def stack_file(job_dir: Path, rank: int, pid: int) -> Path:
    """Where rank `rank` (process `pid`) writes its stack dumps."""
    return job_dir / "stacks" / f"rank{rank}-pid{pid}.txt"


def request_dumps(targets: list[tuple[int, Path]], sig: signal.Signals) -> dict[Path, int]:
    """Signal every (pid, file); returns each file's size before the signal."""
    offsets: dict[Path, int] = {}
    for pid, path in targets:
        offsets[path] = _size(path)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return offsets


def collect_dumps(offsets: dict[Path, int], timeout: float) -> dict[Path, str]:
    """Wait (bounded) until each file has grown and stopped growing; return the new text."""
    deadline = time.monotonic() + timeout
    sizes = dict(offsets)
    settled_since: dict[Path, float] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        for path, start in offsets.items():
            size = _size(path)
            if size > sizes[path]:
                sizes[path] = size
                settled_since.pop(path, None)
            elif size > start and path not in settled_since:
                settled_since[path] = now
        settled = [p for p, t in settled_since.items() if now - t >= _SETTLE_S]
        if len(settled) == len(offsets):
            break
        time.sleep(_POLL_S)
    return {path: _read_from(path, start) for path, start in offsets.items()}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


@dataclasses.dataclass(frozen=True)
class StuckAt:
    """Where a hung rank's main thread was. A rank that waits inside a library (a collective,
    autograd) is usually waiting for another; one stuck in its own code is the likely cause."""

    frame: str
    in_library: bool
    caller: str | None = None
    """The innermost frame of the user's code, when `frame` is inside a library."""

    def describe(self) -> str:
        if not self.in_library:
            return f"at {self.frame}"
        via = f", called from {self.caller}" if self.caller else ""
        return f"waiting inside {self.frame}{via}"


class _Frame(NamedTuple):
    path: str
    line: str
    func: str


def where_stuck(dump: str) -> StuckAt | None:
    """Read a faulthandler dump: the main thread's innermost frame, and the user's."""
    threads = _thread_frames(dump)
    main = next((f for f in threads if f and not _is_thread_bootstrap(f[-1])), None)
    if not main:
        return None
    innermost = main[0]
    if not is_library(innermost.path):
        return StuckAt(_short(innermost, library=False), in_library=False)
    own = (_short(frame, library=False) for frame in main if not is_library(frame.path))
    return StuckAt(_short(innermost, library=True), in_library=True, caller=next(own, None))


def _thread_frames(dump: str) -> list[list[_Frame]]:
    """Each thread's frames, innermost first."""
    threads: list[list[_Frame]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif threads and (match := _FRAME.match(line)):
            threads[-1].append(_Frame(match["path"], match["line"], match["func"]))
    return threads


def _is_thread_bootstrap(frame: _Frame) -> bool:
    return frame.path.endswith("threading.py") and frame.func == "_bootstrap"


def is_library(path: str) -> bool:
    """Whether a frame's file is the interpreter's, an installed package's or ftrun's own;
    anything else is the user's code."""
    return bool(_LIBRARY.search(path)) or path.startswith(_FTRUN_DIR)


def _short(frame: _Frame, library: bool) -> str:
    """`torch/autograd/graph.py:979 in f` for a package, `train.py:63 in f` for user code."""
    if library:  # what follows site-packages/, else what follows lib/python3.N/
        path = _STDLIB.split(_PACKAGES.split(frame.path)[-1])[-1]
    else:
        path = os.path.basename(frame.path)
    return f"{path}:{frame.line} in {frame.func}"
