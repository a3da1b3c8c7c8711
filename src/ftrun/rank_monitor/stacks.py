"""Capturing a hung rank's Python stacks through the faulthandler the client registered.

faulthandler's handler is C code that needs no GIL, so it dumps even when the rank is stuck in a
collective or a C extension. The dump goes to a file the server names (never the client), and
the server reads only what was appended after it sent the signal.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_SETTLE_S = 0.005
_POLL_S = 0.002


def stack_file(job_dir: Path, rank: int, pid: int) -> Path:
    """Where rank `rank` (process `pid`) writes its stack dumps."""
    return job_dir / "stacks" / f"rank{rank}-pid{pid}.txt"


def request_dumps(targets: list[tuple[int, Path]], sig: signal.Signals) -> dict[Path, int]:
    """Signal every (pid, file); returns each file's size before the signal."""
    offsets: dict[Path, int] = {}
    for pid, path in targets:
        offsets[path] = _size(path)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
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
