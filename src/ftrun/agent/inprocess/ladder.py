"""Which rung recovers a fault: in-process first, the in-job restart when that cannot work.

The ladder, lowest first: in-process (the wrapped ranks restart their function in the same
processes) -> in-job restart of the workers (the policy's restart vote) -> spare node /
exclusion -> the job's exit code (both decided by `diagnosis.repeats` as for any failure).
This module decides the first step only; the rest is the policy's existing failure path.

In-process needs wrapped ranks on this node for the current cycle (`link.Coordination`). A hang
judged by the rank monitor is interrupted in the ranks' processes; a rank whose process was
killed by a signal (SIGKILL, a segfault) is started again alone, and joins the others' next
iteration (`REPLACE_RANK`). A stopped rank (SIGSTOP) cannot run its watcher, and a rank whose
wrapper exited with a code gave up on purpose (an abort that hung, a failed health check): both
take the in-job restart. So does any fault after `MAX_ATTEMPTS` in-process restarts within
`WINDOW_S`: they did not cure it.
"""

from __future__ import annotations

import dataclasses
import enum

MAX_ATTEMPTS = 3
WINDOW_S = 120.0


class Rung(enum.Enum):
    IN_PROCESS = "in_process"
    REPLACE_RANK = "replace_rank"
    IN_JOB = "in_job"


@dataclasses.dataclass(frozen=True)
class Decision:
    rung: Rung
    why: str


def for_hang(wrapped: bool, stopped: bool, recent_attempts: int) -> Decision:
    """The first rung for a hang verdict of this node's ranks."""
    if stopped and wrapped:
        return Decision(Rung.IN_JOB, "a stopped rank cannot be interrupted in its process")
    return _unless_cannot(wrapped, recent_attempts) or Decision(
        Rung.IN_PROCESS, "the wrapped ranks restart their function in-process"
    )


def for_lost_rank(wrapped: bool, returncode: int, recent_attempts: int) -> Decision:
    """The first rung for a wrapped rank's process that ended while the others run."""
    if returncode >= 0 and wrapped:  # the wrapper gave up (abort, health check, barrier)
        return Decision(Rung.IN_JOB, f"the rank's wrapper gave up (exit {returncode})")
    return _unless_cannot(wrapped, recent_attempts) or Decision(
        Rung.REPLACE_RANK, "only the lost rank's process is started again"
    )


def _unless_cannot(wrapped: bool, recent_attempts: int) -> Decision | None:
    """The in-job restart where no in-process rung can work for any fault: ranks that do not
    wrap, or in-process restarts that did not cure it; None: an in-process rung may."""
    if not wrapped:
        return Decision(Rung.IN_JOB, "the ranks do not run ftrun.inprocess.Wrapper")
    if recent_attempts >= MAX_ATTEMPTS:
        return Decision(Rung.IN_JOB, f"{recent_attempts} in-process restarts in "
                                     f"{WINDOW_S:g}s did not cure it")  # fmt: skip
    return None
