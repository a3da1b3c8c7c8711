"""The writer the agent appends its events to (`EventLog`), checked against `schema.SCHEMA`."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftrun.errors import ConfigError
from ftrun.eventlog.schema import problems

log = logging.getLogger("ftrun.agent")


def log_dir_error(log_dir: Path, exc: OSError) -> ConfigError:
    """The one-line error for a --log-dir that events cannot be written under."""
    # mkdir's exist_ok covers only a directory: a file in the way raises FileExistsError.
    reason = "Not a directory" if isinstance(exc, FileExistsError) else exc.strerror or exc
    return ConfigError(f"--log-dir {log_dir}: {reason}")


class EventLog:
    """Appends events to `<log dir>/events-<node>.jsonl`, one flushed line each.

    An event that does not match `SCHEMA` is a bug: it is logged as an error and written all
    the same (the reader skips it), since a launcher must not fail a job over its bookkeeping.

    Live readers (the metrics, the status page's feed) `subscribe`: each gets every record
    right after it is written, in the writer's thread, so a reader only queues or counts.
    """

    def __init__(self, log_dir: Path, node: str) -> None:
        self.path = log_dir / f"events-{node}.jsonl"
        self._node = node
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")
        self._readers: list[Callable[[Mapping[str, Any]], None]] = []
        self.cycle = 0

    def subscribe(self, reader: Callable[[Mapping[str, Any]], None]) -> None:
        """Call `reader(record)` with every event written from now on."""
        with self._lock:
            self._readers.append(reader)

    def emit(self, event: str, **fields: Any) -> None:
        for problem in problems(event, fields):
            log.error("event does not match its schema (a bug): %s", problem)
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
            readers = tuple(self._readers)
        for reader in readers:
            try:
                reader(record)
            except Exception:  # a reader's bug must not cost the job its events
                log.exception("an event reader failed on %s", event)

    def close(self) -> None:
        with self._lock:
            self._file.close()
