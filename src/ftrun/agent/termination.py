"""The one termination routine: deliver (a signal, a grace period, SIGKILL), then wait, bounded.

Every place that stops processes uses it: the agent's stop (`terminate`, whole process groups
with a `Delivery`), a hung rank killed at once and a timed-out health command
(`kill_group_now`), the fork server's children at its end (`kill_group_now`, `wait_reaped`).
A stopped process (SIGSTOP, a debugger) acts on no signal but SIGKILL: `terminate` sends it
SIGKILL at once instead of waiting out the grace for it (`kill_at_once` decides who).

Whole process groups: each worker leads its own group, so its children and grandchildren get
the signal too. Descendants that moved to another group (setsid) are found through psutil
(the agent is a child subreaper, so orphans stay its descendants) and signalled one by one.

Waiting: on pidfds (`exits.wait_exited`), which become readable when a process exits, a
non-child's too, and never reap it: the workers' exit statuses stay for the exit waiter
(`exits.ExitWaiter`), which reads them from the workers' handles. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Collection, Mapping
from typing import Protocol

import psutil

from ftrun.agent.exits import running, wait_exited
from ftrun.rank_monitor.process_state import cannot_act, status_of

log = logging.getLogger("ftrun.agent")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_WAIT_S = 5.0
"""How long SIGKILLed processes get to disappear before they count as survivors."""
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned grandchildren of workers re-parent to the agent instead of init."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def die_with_parent() -> None:
    """For `preexec_fn`: the worker gets SIGKILL if its agent dies (even by SIGKILL)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclasses.dataclass(frozen=True)
class Delivery:
    """How processes are asked to go: `first`, then SIGKILL for those still there after
    `grace` seconds (none when `first` is SIGKILL)."""

    first: signal.Signals
    grace: float
    drain: float = 0.0
    """Seconds the leaders get to exit on their own before `first` is sent: workers that leave
    by themselves (ranks exiting 16 once their part of a re-run's checkpoint is saved)."""

    @classmethod
    def graceful(cls, sig: signal.Signals, grace: float, drain: bool = False) -> Delivery:
        """`drain`: the leaders get `grace` seconds to exit on their own first."""
        return cls(sig, grace, grace if drain else 0.0)


@dataclasses.dataclass(frozen=True)
class StopResult:
    duration: float
    killed: int
    """Processes still there when the grace period ended (sent SIGKILL then)."""
    survivors: int
    """Processes still alive after SIGKILL and the bounded wait (should be 0)."""
    stopped: int = 0
    """Stopped processes (SIGSTOP, a debugger) sent SIGKILL at once: no grace helps them."""


def kill_at_once(
    leaders: Collection[int], statuses: Mapping[int, str | None]
) -> tuple[list[int], list[int]]:
    """Who gets SIGKILL without waiting out the grace: (process groups, single processes).

    A stopped process acts on no signal but SIGKILL, so the grace would only be waited out. A
    stopped group leader (a rank) takes its group along: what its children could still save
    on SIGTERM needs the rank itself. A stopped descendant goes alone: its rank may still be
    saving its checkpoint. `statuses`: pid -> psutil's name for its state (None: gone)."""
    stopped = [pid for pid, status in statuses.items() if cannot_act(status)]
    return [p for p in stopped if p in leaders], [p for p in stopped if p not in leaders]


def terminate(
    leaders: list[int], delivery: Delivery, keep: frozenset[int] = frozenset()
) -> StopResult:
    """Stop every process in the groups led by `leaders`, and every stray descendant.

    `keep` holds pids never to signal: the node services' own processes (the fork server).
    """
    started = time.monotonic()
    if delivery.drain > 0:
        wait_exited(leaders, delivery.drain)
    targets, orphans = _targets(leaders, keep)
    _signal_all(leaders, targets, delivery.first)
    stopped = _kill_stopped(leaders, targets) if delivery.first != signal.SIGKILL else 0
    alive = wait_gone(targets, delivery.grace)
    later, more_orphans = _targets(leaders, keep)
    signalled = {t.pid for t in targets}
    late = [p for p in later if p.pid not in signalled]
    alive += late
    orphans |= more_orphans
    killed = len(alive)
    if alive:
        if delivery.first != signal.SIGKILL:
            log.warning("%d process(es) ignored %s; sending SIGKILL: %s", killed,
                        delivery.first.name, _describe(alive, late))  # fmt: skip
        _signal_all(leaders, alive, signal.SIGKILL)
        alive = wait_gone(alive, KILL_WAIT_S)
    _reap(orphans)
    for proc in alive:
        log.error("process %d survived SIGKILL", proc.pid)
    return StopResult(time.monotonic() - started, killed, len(alive), stopped)


class Termination(Protocol):
    """What the agent needs to stop workers: the real one is `PROCESSES`; a test's fake stops
    fake workers."""

    def terminate(
        self, leaders: list[int], delivery: Delivery, keep: frozenset[int] = frozenset()
    ) -> StopResult: ...

    def kill_now(self, pid: int) -> None: ...


def kill_group_now(pid: int) -> None:
    """SIGKILL the process group `pid` leads, and `pid` itself (in case it does not lead one
    yet); a process already gone is not an error."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def wait_reaped(pid: int, timeout: float) -> int | None:
    """Wait (at most `timeout`) for our child `pid` to exit and reap it: its exit code, or
    None if it is still running at the deadline (or is not our child)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        wait_exited([pid], min(left, 1.0))


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait (at most `timeout`) until each process has exited (a zombie counts as exited);
    returns those still running. Never reaps: a child's status stays for its own waiter."""
    alive = [p for p in procs if running(p)]
    if alive and timeout > 0:
        wait_exited([p.pid for p in alive], timeout)
        alive = [p for p in alive if running(p)]
    return alive


def _targets(leaders: list[int], keep: frozenset[int]) -> tuple[list[psutil.Process], set[int]]:
    """(every process to signal, the orphans among them: our children that no Popen owns)."""
    found: dict[int, psutil.Process] = {}
    orphans: set[int] = set()
    for pid in leaders:
        with contextlib.suppress(psutil.Error):
            leader = psutil.Process(pid)
            found[pid] = leader
            for child in leader.children(recursive=True):
                found[child.pid] = child
    groups = set(leaders)
    for proc in psutil.Process().children(recursive=True):
        # A process may end between the listing and the look: psutil says so with its own
        # error, os.getpgid with ProcessLookupError.
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) in groups:
                found[proc.pid] = proc
            if proc.ppid() == os.getpid() and proc.pid not in leaders and proc.pid not in keep:
                orphans.add(proc.pid)
                found[proc.pid] = proc
    return [proc for pid, proc in found.items() if pid not in keep and pid != os.getpid()], orphans


def _describe(procs: list[psutil.Process], late: list[psutil.Process]) -> str:
    """'pid name, ...'; a process first seen after the signal (not sent it) says so."""
    found = []
    for proc in procs:
        try:
            name = proc.name()
        except psutil.Error:
            name = "gone"
        found.append(f"{proc.pid} {name}{' (appeared after the signal)' if proc in late else ''}")
    return ", ".join(found)


def _reap(orphans: set[int]) -> None:
    """Collect the exit status of orphans that re-parented to us (never a Popen's child: its
    Popen would then report a clean exit)."""
    for pid in orphans:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _kill_stopped(leaders: list[int], targets: list[psutil.Process]) -> int:
    """SIGKILL the stopped processes among `targets` now (`kill_at_once`); how many there were."""
    statuses = {proc.pid: status_of(proc.pid) for proc in targets}
    groups, alone = kill_at_once(leaders, statuses)
    for pid in groups:
        kill_group_now(pid)
    for pid in alone:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if groups or alone:
        log.warning("killed %d stopped process(es) at once (SIGSTOP or a debugger: they act on "
                    "no signal but SIGKILL): %s", len(groups) + len(alone),
                    ", ".join(str(p) for p in [*groups, *alone]))  # fmt: skip
    return len(groups) + len(alone)


def _signal_all(leaders: list[int], procs: list[psutil.Process], sig: signal.Signals) -> None:
    for pgid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


class _Processes:
    """`Termination` over real processes."""

    terminate = staticmethod(terminate)
    kill_now = staticmethod(kill_group_now)


PROCESSES: Termination = _Processes()
