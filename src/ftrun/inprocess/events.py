"""What a wrapped rank tells about its restarts: a log line, and under `ft_launcher` a report to
its node's agent (`inprocess_protocol.Report`, on the rank monitor's connection), which turns
them into events (`ftrun report`, metrics, the status page) and into its ladder's decisions."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from ftrun.environment import Env
from ftrun.inprocess_protocol import Interruption, Report, ReportKind, root_cause
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.sender import MonitorSender

log = logging.getLogger("ftrun.inprocess")


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


class AgentReports:
    """One rank's reports to its agent: fire-and-forget frames (`MonitorSender`) on the
    process-wide ZeroMQ context, whose I/O and reaper threads are the wrapper's cost; without
    a launcher, log lines only."""

    def __init__(self, rank: int, cycle: int | None, address: str | None) -> None:
        self.rank, self._cycle = rank, cycle
        self._sender = MonitorSender(address) if address else None

    @classmethod
    def for_rank(cls, rank: int, environ: Mapping[str, str] = os.environ) -> AgentReports:
        cycle = environ.get(Env.CYCLE, "")
        return cls(rank, int(cycle) if cycle.isdigit() else None, environ.get(Env.MONITOR_ADDR))

    def wrapped(self, address: str, prefix: str) -> None:
        """This rank runs the wrapper; its ranks coordinate at `address` under `prefix`: a hang
        the rank monitor judges is then interrupted in-process, through the same store."""
        self._send(Report(ReportKind.WRAPPED, self._cycle, address=address, prefix=prefix))

    def recovered(self, iteration: int, causes: list[Interruption], seconds: float) -> None:
        first = root_cause(causes)
        cause = f"{first.kind} on rank {first.rank}: {first.why}" if first else "unknown"
        alone = self._sender is None  # under a launcher its agent says it, once a node
        if alone and ((first is not None and first.rank == self.rank) or self.rank == 0):
            log.warning("in-process restart: iteration %d -> %d after %s (ready in %.3fs)",
                        iteration, iteration + 1, cause, seconds)  # fmt: skip
        # The report's seconds: from the fault (its record's time) to every rank ready.
        ready = round(max(0.0, time.time() - min(c.at for c in causes)), 4) if causes else None
        self._send(Report(ReportKind.RECOVERED, self._cycle, iteration, cause=first,
                          seconds=ready))  # fmt: skip

    def entered(self, iteration: int, phases: dict[str, float], elapsed: float) -> None:
        """This rank calls the function again, `elapsed` s after its main thread stopped:
        where its restart's time went (a log line)."""
        split = ", ".join(f"{name} {seconds:.3f}s" for name, seconds in phases.items())
        log.info("in-process restart: rank %d entered iteration %d after %.3fs: %s",
                 self.rank, iteration, elapsed, split)  # fmt: skip

    def left(self, iteration: int, why: str) -> None:
        log.error("in-process restart: rank %d leaves at iteration %d: %s",
                  self.rank, iteration, why)  # fmt: skip
        self._send(Report(ReportKind.LEFT, self._cycle, iteration, why=why))

    def gave_up(self, iteration: int, why: str) -> None:
        """In-process restart cannot cure it: the caller ends the process next."""
        self._send(Report(ReportKind.GAVE_UP, self._cycle, iteration, why=why))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def _send(self, report: Report) -> None:
        # The agent's queue full: the report is lost (and counted), the log line stays.
        if self._sender is not None:
            self._sender.send(wire.InprocessNote(self.rank, os.getpid(), report))
