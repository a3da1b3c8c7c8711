"""Workload control: a worker asks its launcher to act on the whole workload.

The names follow NVIDIA Resiliency Extension's client (`WorkloadAction`,
`WorkloadControlRequest`, `RankMonitorClient.send_workload_control_request`), so a training
script written for it needs only an import change. A rank sends a `WorkloadControlRequest`; the
node's monitor server checks who sent it and hands its owner (the agent) a `WorkloadControl`.

Torch-free and psutil-free: the in-worker client imports this module.
"""

from __future__ import annotations

import dataclasses
import enum

MAX_DESCRIPTION_LEN = 1024
"""Longer descriptions are truncated to this many characters (the last three being "...")."""
_TRUNCATED = "..."


class WorkloadAction(enum.Enum):
    """What a worker asks the launcher to do with the workload."""

    Continue = 0
    """Nothing changes: the request is only logged."""
    ExcludeThisNode = 1
    """The cycle ends and this node leaves the job: a spare node or the elastic minimum of
    nodes takes over (for a node the worker found unhealthy: a bad GPU, a flaky link)."""
    ShutdownWorkload = 2
    """The whole job stops, with an exit code that says: do not relaunch."""


@dataclasses.dataclass(frozen=True)
class WorkloadControlRequest:
    """A worker's request to the launcher: `action`, and why (`description`, for the logs).

    A description longer than `MAX_DESCRIPTION_LEN` (1024) characters is truncated to 1024
    characters, ending with "...".
    """

    action: WorkloadAction
    description: str = "<not set>"

    def __post_init__(self) -> None:
        if not isinstance(self.action, WorkloadAction):
            raise TypeError(
                f"action must be a WorkloadAction (e.g. WorkloadAction.ExcludeThisNode), "
                f"not {type(self.action).__name__}"
            )
        if not isinstance(self.description, str):
            raise TypeError(f"description must be a str, not {type(self.description).__name__}")
        object.__setattr__(self, "description", truncated(str(self.description)))


@dataclasses.dataclass(frozen=True)
class WorkloadControl:
    """A registered rank's workload control request, as the server hands it to its owner."""

    rank: int
    pid: int
    """The process that registered (may be a descendant of the spawned worker)."""
    worker_pid: int
    """The pid the owner registered with `expect_rank` (as in `Verdict`)."""
    action: WorkloadAction
    description: str
    at: float
    """The server's monotonic clock when the request arrived."""

    def describe(self) -> str:
        """One log line (the description quoted, so that it cannot forge lines)."""
        return (
            f"rank {self.rank} (pid {self.pid}) requests {self.action.name}: {self.description!r}"
        )


def truncated(description: str) -> str:
    """`description`, cut to `MAX_DESCRIPTION_LEN` characters if longer."""
    if len(description) <= MAX_DESCRIPTION_LEN:
        return description
    return description[: MAX_DESCRIPTION_LEN - len(_TRUNCATED)] + _TRUNCATED
