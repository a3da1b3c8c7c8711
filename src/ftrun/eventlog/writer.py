"""The writer the agent appends its events to (`EventLog`), checked against `schema.SCHEMA`."""

from __future__ import annotations

import json
import logging
import os
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
    """Appends events to `<log dir>/events-<node>.jsonl`, one O_APPEND write a line.

    An event that does not match `SCHEMA` is a bug: it is logged as an error and written all
    the same (the reader skips it), since a launcher must not fail a job over its bookkeeping.

    Live readers (the metrics, the status page's feed) `subscribe`: each gets every record
    right after it is written, in the writer's thread, so a reader only queues or counts.
    """

    def __init__(self, log_dir: Path, node: str) -> None:
        self.path = log_dir / f"events-{node}.jsonl"
        self._node = node
        self._lock = threading.Lock()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o644)
        self._failing = False  # the last write failed
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
        line = (json.dumps(record, default=str) + "\n").encode()
        with self._lock:
            self._write(line)
            readers = tuple(self._readers)
        for reader in readers:
            try:
                reader(record)
            except Exception:  # a reader's bug must not cost the job its events
                log.exception("an event reader failed on %s", event)

    def _write(self, line: bytes) -> None:
        """One O_APPEND write a line. A full or failing log disk costs the events written
        meanwhile, never the job: one warning when it starts failing, one when it works again
        (the first line then ends whatever part of a line the failure left)."""
        if self._fd < 0:  # closed: the number may be another file's by now
            return
        data = b"\n" + line if self._failing else line
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            if not self._failing:
                log.warning("events are not written to %s: %s", self.path, e.strerror or e)
            self._failing = True
            return
        if self._failing:
            log.warning("events are written to %s again", self.path)
            self._failing = False

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
