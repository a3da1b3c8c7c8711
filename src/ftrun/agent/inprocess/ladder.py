"""Which rung recovers a fault: in-process first, the in-job restart when that cannot work.

The ladder, lowest first: in-process (the wrapped ranks restart their function in the same
processes) -> in-job restart of the workers (the policy's restart vote) -> spare node /
exclusion -> the job's exit code (both decided by `diagnosis.repeats` as for any failure).
This module decides the first step only; the rest is the policy's existing failure path.

In-process needs wrapped ranks on this node for the current cycle (`link.Coordination`) and a
fault that leaves their processes alive: a hang judged by the rank monitor. A rank that is
stopped (SIGSTOP) cannot run its watcher, and one whose process is gone cannot be reached: both
take the in-job restart. So does the same hang again after `MAX_ATTEMPTS` in-process attempts
within `WINDOW_S`: interrupting did not cure it.
"""

from __future__ import annotations

import dataclasses
import enum

MAX_ATTEMPTS = 3
WINDOW_S = 120.0


class Rung(enum.Enum):
    IN_PROCESS = "in_process"
    IN_JOB = "in_job"


@dataclasses.dataclass(frozen=True)
class Decision:
    rung: Rung
    why: str


def for_hang(wrapped: bool, stopped: bool, recent_attempts: int) -> Decision:
    """The first rung for a hang verdict of this node's ranks."""
    if not wrapped:
        return Decision(Rung.IN_JOB, "the ranks do not run ftrun.inprocess.Wrapper")
    if stopped:
        return Decision(Rung.IN_JOB, "a stopped rank cannot be interrupted in its process")
    if recent_attempts >= MAX_ATTEMPTS:
        return Decision(Rung.IN_JOB, f"{recent_attempts} in-process restarts in "
                                     f"{WINDOW_S:g}s did not cure it")  # fmt: skip
    return Decision(Rung.IN_PROCESS, "the wrapped ranks restart their function in-process")
