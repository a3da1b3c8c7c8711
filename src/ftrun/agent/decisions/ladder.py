"""Which rung recovers a fault: in-process first, the in-job restart when that cannot work.

The ladder, lowest first: in-process (the wrapped ranks restart their function in the same
processes) -> in-job restart of the workers (the policy's restart vote) -> spare node /
exclusion -> the job's exit code (both decided by `diagnosis.repeats` as for any failure).
This module decides the first step only; the rest is the policy's existing failure path.

In-process needs wrapped ranks on this node for the current cycle (one said so on the rank
monitor's connection). A hang judged by the rank monitor is interrupted in the ranks'
processes; a rank whose process was killed by a signal (SIGKILL, a segfault) is started again
alone, and joins the others' next iteration (`REPLACE_RANK`). A stopped rank (SIGSTOP) cannot
run its watcher, and a rank whose wrapper exited with a code gave up on purpose (an abort that
hung, a failed health check, the budget spent): both take the in-job restart. So does any
fault once the cycle's restart budget (`inprocess_protocol.RestartBudget`, the same the ranks
apply to their own faults) is spent.
"""

from __future__ import annotations

import dataclasses
import enum


class Rung(enum.Enum):
    IN_PROCESS = "in_process"
    REPLACE_RANK = "replace_rank"
    IN_JOB = "in_job"


@dataclasses.dataclass(frozen=True)
class Decision:
    rung: Rung
    why: str


def for_hang(wrapped: bool, stopped: bool, spent: str | None) -> Decision:
    """The first rung for a hang verdict of this node's ranks (`spent`: why the budget allows
    no further in-process restart, or None)."""
    if stopped and wrapped:
        return Decision(Rung.IN_JOB, "a stopped rank cannot be interrupted in its process")
    return _unless_cannot(wrapped, spent) or Decision(
        Rung.IN_PROCESS, "the wrapped ranks restart their function in-process"
    )


def for_lost_rank(wrapped: bool, returncode: int, spent: str | None) -> Decision:
    """The first rung for a wrapped rank's process that ended while the others run."""
    if returncode >= 0 and wrapped:  # the wrapper gave up (abort, health check, budget)
        return Decision(Rung.IN_JOB, f"the rank's wrapper gave up (exit {returncode})")
    return _unless_cannot(wrapped, spent) or Decision(
        Rung.REPLACE_RANK, "only the lost rank's process is started again"
    )


def _unless_cannot(wrapped: bool, spent: str | None) -> Decision | None:
    """The in-job restart where no in-process rung can work for any fault: ranks that do not
    wrap, or a spent budget; None: an in-process rung may."""
    if not wrapped:
        return Decision(Rung.IN_JOB, "the ranks do not run ftrun.inprocess.Wrapper")
    if spent is not None:
        return Decision(Rung.IN_JOB, spent)
    return None
