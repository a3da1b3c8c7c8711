"""What the rank monitor tells its owner: hang verdicts and progress notes (plain records)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ftrun.rank_monitor.protocol import Timeouts
from ftrun.rank_monitor.stacks import StuckAt
from ftrun.rank_monitor.tracker import HangKind


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A rank declared hung: who, why, how long it was waited for, and where it was stuck."""

    rank: int
    pid: int
    """The process that registered (may be a descendant of the spawned worker)."""
    worker_pid: int
    """The pid the owner registered with `expect_rank`: the worker's process group leader."""
    kind: HangKind
    section: str | None
    timeout: float
    waited: float
    deadline: float
    detected_at: float
    stack_file: Path | None
    stack: str
    stopped: bool = False
    """The process was stopped (SIGSTOP, a debugger): it can act on nothing but SIGKILL, so it
    was not asked for its stacks, and the ranks that wait for it are not the cause."""
    stuck: StuckAt | None = None
    """Where `stack` shows the rank stuck (`stacks.where_stuck`, read once, when the stacks
    came in); None without a readable dump."""

    def describe(self) -> str:
        what = f"section {self.section!r}" if self.kind is HangKind.SECTION else self.kind.value
        stacks = "none: the process is stopped" if self.stopped else "not captured"
        return (
            f"rank {self.rank} (pid {self.pid}) hung: {what} timeout {self.timeout:.3g}s, "
            f"waited {self.waited:.3f}s; stacks: {self.stack_file or stacks}"
        )


@dataclasses.dataclass(frozen=True)
class FirstProgress:
    """A rank showed progress for the first time since it registered."""

    rank: int
    pid: int
    worker_pid: int
    """The pid the owner registered with `expect_rank` (as in `Verdict`)."""
    at: float
    """The server's monotonic clock when the heartbeat or section end arrived."""
    iteration: int | None
    """The iteration the rank reported with it, if any."""


@dataclasses.dataclass(frozen=True)
class ProgressSnapshot:
    """Where one rank's current registration got to; times on the server's monotonic clock."""

    rank: int
    pid: int
    worker_pid: int
    first_progress: float | None
    last_progress: float | None
    first_iteration: int | None
    last_iteration: int | None
    timeouts: Timeouts | None = None
    """The timeouts the monitor judges this rank by now (configured, or calculated)."""
