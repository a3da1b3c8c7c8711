"""What a wrapped rank tells about its restarts: a log line, and under `ft_launcher` a JSON line
in `<FTRUN_IPC_DIR>/inprocess/rank<N>.jsonl` (the job's 0700 directory) for its agent, which
turns them into events (`ftrun report`, metrics, the status page)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO

from ftrun.inprocess.iteration import Interruption, root_cause

log = logging.getLogger("ftrun.inprocess")

IPC_DIR_ENV = "FTRUN_IPC_DIR"
SUBDIR = "inprocess"
COORDINATION_FILE = "coordination.json"


class PhaseClock:
    """Where one restart's time goes on this rank: the seconds of each phase, from the fault
    seen to the function entered again (`mark` does nothing outside a restart)."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._started = 0.0
        self.phases: dict[str, float] = {}

    def start(self) -> None:
        self._last, self.phases = time.monotonic(), {}
        self._started = self._last

    @property
    def elapsed(self) -> float:
        """Seconds from `start` to the last mark."""
        return 0.0 if self._last is None else self._last - self._started

    def record(self, phase: str, seconds: float) -> None:
        """A phase timed elsewhere (the watcher thread's abort, before this rank's main thread
        stopped): kept beside the marked ones, the clock not moved."""
        if self._last is not None:
            self.phases[phase] = round(seconds, 4)

    def mark(self, phase: str) -> None:
        if self._last is not None:
            now = time.monotonic()
            self.phases[phase] = round(now - self._last, 4)
            self._last = now

    def take(self) -> dict[str, float] | None:
        """The phases of the restart just ended (None: no restart since the last take)."""
        taken = self.phases if self._last is not None else None
        self._last, self.phases = None, {}
        return taken


class EventWriter:
    """One rank's in-process restart records."""

    def __init__(self, rank: int, out: IO[str] | None) -> None:
        self.rank, self._out = rank, out

    @classmethod
    def for_rank(cls, rank: int, environ: dict[str, str] | None = None) -> EventWriter:
        ipc_dir = (os.environ if environ is None else environ).get(IPC_DIR_ENV)
        if not ipc_dir:
            return cls(rank, None)
        folder = Path(ipc_dir) / SUBDIR
        folder.mkdir(mode=0o700, exist_ok=True)
        return cls(rank, (folder / f"rank{rank}.jsonl").open("a", encoding="utf-8"))

    def announce(self, address: str, prefix: str, cycle: str | None) -> None:
        """Tell this node's agent where the ranks coordinate (`coordination.json`): a hang its
        rank monitor judges is then interrupted in-process, through the same store."""
        if self._out is None or not address:
            return
        target = Path(self._out.name).with_name(COORDINATION_FILE)
        record = {"address": address, "prefix": prefix, "cycle": cycle, "time": time.time()}
        partial = target.with_suffix(f".{self.rank}.tmp")
        partial.write_text(json.dumps(record))
        partial.replace(target)  # atomic: the agent never reads half a file

    def recovered(self, iteration: int, causes: list[Interruption], seconds: float) -> None:
        first = root_cause(causes)
        cause = f"{first.kind} on rank {first.rank}: {first.why}" if first else "unknown"
        if (first is not None and first.rank == self.rank) or self.rank == 0:
            log.warning("in-process restart: iteration %d -> %d after %s (ready in %.3fs)",
                        iteration, iteration + 1, cause, seconds)  # fmt: skip
        causes_out = [c.__dict__ for c in causes]
        self._write({"event": "inprocess_recovered", "iteration": iteration,
                     "causes": causes_out, "seconds": round(seconds, 4)})  # fmt: skip

    def entered(self, iteration: int, phases: dict[str, float], elapsed: float) -> None:
        """This rank calls the function again, `elapsed` s after its main thread stopped:
        where its restart's time went."""
        split = ", ".join(f"{name} {seconds:.3f}s" for name, seconds in phases.items())
        log.info("in-process restart: rank %d entered iteration %d after %.3fs: %s",
                 self.rank, iteration, elapsed, split)  # fmt: skip
        self._write({"event": "inprocess_entered", "iteration": iteration, "phases": phases})

    def left(self, iteration: int, why: str) -> None:
        log.error("in-process restart: rank %d leaves at iteration %d: %s",
                  self.rank, iteration, why)  # fmt: skip
        self._write({"event": "inprocess_left", "iteration": iteration, "why": why})

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _write(self, record: dict[str, object]) -> None:
        if self._out is None:
            return
        self._out.write(json.dumps({"time": time.time(), "rank": self.rank, **record}) + "\n")
        self._out.flush()
