"""Whether a process can act at all: its state read from /proc (the effect), judged apart (pure).

A stopped process (SIGSTOP, as NVRx's examples simulate a hung rank, or a debugger's stop: state
`T` or `t` in /proc/<pid>/stat) runs no code until SIGCONT: it dumps no stacks, answers no
flight-recorder request and acts on no SIGTERM; only SIGKILL reaches it. Whoever would ask it
something and wait for the answer asks `is_stopped` first: the answer can never come; one that
already waits stops waiting for a process that can no longer answer (`answers`).
"""

from __future__ import annotations

import psutil

STOPPED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})
"""psutil's names for /proc states `T` (stopped by a signal) and `t` (stopped by a tracer)."""


def cannot_act(status: str | None) -> bool:
    """Whether a process in `status` (psutil's name for its state; None: gone) can act on no
    signal but SIGKILL."""
    return status in STOPPED


def can_answer(status: str | None) -> bool:
    """Whether a process in `status` may still answer a request (write a dump): it runs, not
    stopped, not gone or a zombie."""
    return status is not None and status != psutil.STATUS_ZOMBIE and not cannot_act(status)


def status_of(pid: int) -> str | None:
    """psutil's name for the state of process `pid` (from /proc/<pid>/stat); None if gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def is_stopped(pid: int) -> bool:
    return cannot_act(status_of(pid))


def answers(pid: int) -> bool:
    return can_answer(status_of(pid))
