"""The one bounded termination routine: signal -> deadline -> SIGKILL -> bounded wait.

Whole process groups: each worker leads its own group, so its children and grandchildren get
the signal too. Descendants that moved to another group (setsid) are found through psutil
(the agent is a child subreaper, so orphans stay its descendants) and signalled one by one.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import time

import psutil

log = logging.getLogger("ftrun.agent")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_KILL_WAIT_S = 5.0
_POLL_S = 0.005
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned grandchildren of workers re-parent to the agent instead of init."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def die_with_parent() -> None:
    """For `preexec_fn`: the worker gets SIGKILL if its agent dies (even by SIGKILL)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclasses.dataclass(frozen=True)
class StopResult:
    duration: float
    killed: int
    """Processes that needed SIGKILL."""
    survivors: int
    """Processes still alive after SIGKILL and the bounded wait (should be 0)."""


def stop_process_groups(
    leaders: list[int], sig: signal.Signals, timeout: float, keep: frozenset[int] = frozenset()
) -> StopResult:
    """Stop every process in the groups led by `leaders`, and every stray descendant.

    `keep` holds pids never to signal: the node services' own processes (the fork server).
    """
    started = time.monotonic()
    targets = _targets(leaders, keep)
    _signal_all(leaders, targets, sig)
    alive = _wait_gone(targets, timeout)
    alive += [p for p in _targets(leaders, keep) if p not in targets]
    killed = len(alive)
    if alive:
        log.warning("%d process(es) ignored %s; sending SIGKILL", killed, sig.name)
        _signal_all(leaders, alive, signal.SIGKILL)
        alive = _wait_gone(alive, _KILL_WAIT_S)
    reap_orphans()
    for proc in alive:
        log.error("process %d survived SIGKILL", proc.pid)
    return StopResult(time.monotonic() - started, killed, len(alive))


def reap_orphans() -> None:
    """Collect exit statuses of orphans that re-parented to us (never our own Popen children).

    Only pids that are not Popen-managed are waited for: reaping a worker's status here would
    make its Popen report a clean exit.
    """
    me = psutil.Process()
    for child in me.children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if child.status() == psutil.STATUS_ZOMBIE and child.pid in _ORPHANS:
                os.waitpid(child.pid, os.WNOHANG)
                _ORPHANS.discard(child.pid)


_ORPHANS: set[int] = set()


def _targets(leaders: list[int], keep: frozenset[int]) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
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
                _ORPHANS.add(proc.pid)
                found[proc.pid] = proc
    return [proc for pid, proc in found.items() if pid not in keep and pid != os.getpid()]


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie counts as exited); returns the rest.

    Not psutil.wait_procs: for our own children it calls waitpid, stealing the exit status
    that the workers' Popen objects are waiting for.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(_POLL_S)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_all(leaders: list[int], procs: list[psutil.Process], sig: signal.Signals) -> None:
    for pgid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
