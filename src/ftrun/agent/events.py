"""The node's events file: one JSON object per line, the single source for reports and benches.

Every event has `event`, `ts` (wall clock, for people), `mono` (monotonic, for durations within
one node), `node` and `cycle` (the job-wide cycle number, equal on every node).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ftrun.agent")


class EventLog:
    """Appends events to `<log dir>/events-<node>.jsonl`."""

    def __init__(self, log_dir: Path, node: str) -> None:
        self.path = log_dir / f"events-{node}.jsonl"
        self._node = node
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")
        self.cycle = 0

    def emit(self, event: str, **fields: Any) -> None:
        record = {
            "event": event,
            "ts": round(time.time(), 6),
            "mono": round(time.monotonic(), 6),
            "node": self._node,
            "cycle": self.cycle,
            **fields,
        }
        line = json.dumps(record, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
