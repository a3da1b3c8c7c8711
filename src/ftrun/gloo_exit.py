"""Letting go of a gloo process group without deadlocking the process (torch 2.13, CPython).

torch's `ProcessGroupGloo` destructor joins its worker threads (`pt_gloo_runloop`) while the
thread that dropped the last reference holds the GIL: DDP's reducer as the script's `main()`
returns, say, after `destroy_process_group()` (which does not stop gloo's threads). A worker
thread marks a collective done first and drops the finished work afterwards; freeing the work's
tensors decrefs their Python objects, which takes the GIL. On a loaded node the worker can be
descheduled between the two, the main thread runs on, frees the group and joins it: each waits
for the other, forever (gdb: the main thread in `std::thread::join` under
`~ProcessGroupGloo`, called from a frame's teardown; a `pt_gloo_runloop` thread in `take_gil`
under `~AsyncAllreduceWork`). The ranks had printed their last line; the launchers never exited.

`wait_gloo_idle` waits, with the GIL let go, until no gloo worker thread of this process is
runnable: each then sleeps on its queue, holding no work, and the destructor's join needs no
GIL. Call it after the last collective and before the last reference to the group goes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping

GLOO_WORKER = "pt_gloo_runloop"
"""The name torch gives a gloo group's worker threads (ProcessGroupGloo::runLoop)."""
IDLE_STATES = frozenset("SDIt")
"""proc(5) states of a thread that waits (sleeping, disk, idle, traced); R is one that has
work left (a worker woken to take the GIL and free a work is runnable, not sleeping)."""


def _task_stats() -> dict[int, str]:
    """/proc/self/task/<tid>/stat of each thread of this process (none off Linux)."""
    stats = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return stats
    for tid in tids:
        # The thread may have ended meanwhile.
        with contextlib.suppress(OSError, ValueError), open(f"/proc/self/task/{tid}/stat") as f:
            stats[int(tid)] = f.read()
    return stats


def busy_gloo_workers(stats: Mapping[int, str]) -> list[int]:
    """The gloo worker threads among `stats` (tid -> its stat line) that are not waiting."""
    busy = []
    for tid, line in stats.items():
        head, sep, tail = line.rpartition(")")
        if not sep or "(" not in head:
            continue
        comm = head.split("(", 1)[1]
        fields = tail.split()
        if comm == GLOO_WORKER and fields and fields[0] not in IDLE_STATES:
            busy.append(tid)
    return sorted(busy)


def wait_gloo_idle(
    timeout: float = 2.0,
    poll_s: float = 0.002,
    read: Callable[[], Mapping[int, str]] = _task_stats,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until no gloo worker thread is busy in two reads `poll_s` apart (the GIL is let go
    in between, so a worker waiting for it gets it); whether that was within `timeout`. True at
    once in a process without gloo threads, or where /proc is not there."""
    deadline = clock() + timeout
    quiet = 0
    while True:
        quiet = 0 if busy_gloo_workers(read()) else quiet + 1
        if quiet >= 2:
            return True
        if clock() >= deadline:
            return False
        sleep(poll_s)
