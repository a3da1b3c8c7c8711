"""What the agent's executor observed and knows when it asks `policy.Policy` to decide: one
frozen dataclass per event, the `AgentEvent` union of them, and the `Facts` read with them."""

from __future__ import annotations

import dataclasses

from ftrun.agent.decisions.attribution import Signature
from ftrun.errors import ExitCode
from ftrun.rank_monitor.workload import WorkloadAction
from ftrun.rendezvous.control import FailureRecord, Shutdown


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How this launcher ends: its exit code and the reason logged with it."""

    code: ExitCode
    reason: str


@dataclasses.dataclass(frozen=True)
class HealthChecked:
    problem: str | None = None
    """None: healthy; else why the node must not run workers."""
    code: ExitCode = ExitCode.DO_NOT_RELAUNCH


@dataclasses.dataclass(frozen=True)
class JoinReady:
    """About to join a round; the answer is to exit, or to stay (join now)."""


@dataclasses.dataclass(frozen=True)
class Joined:
    """This node is in the round."""


@dataclasses.dataclass(frozen=True)
class JoinFailed:
    reason: str
    code: ExitCode = ExitCode.FAILED
    closed: bool = False
    """The rendezvous was closed (a shutdown): exit with the shutdown in force if any."""


@dataclasses.dataclass(frozen=True)
class WorkersStarted:
    pass


@dataclasses.dataclass(frozen=True)
class SpawnFailed:
    reason: str


@dataclasses.dataclass(frozen=True)
class WorkerEnded:
    rank: int
    returncode: int
    """Negative: killed by that signal (Popen's convention)."""
    others_running: int
    """Local workers of this cycle still running after this one."""
    signature: Signature | None = None
    """What the failure looks like (None: not named; restarts as a plain failure)."""


@dataclasses.dataclass(frozen=True)
class HangsFound:
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    """The hung workers' process group leaders: killed at once (they cannot be asked)."""
    kind: str
    signature: Signature | None = None
    stopped: bool = False
    """A hung rank is stopped (SIGSTOP): it cannot be interrupted in its process."""


@dataclasses.dataclass(frozen=True)
class HealthFound:
    """The health watch found a problem on this node while the workers ran."""

    signature: Signature
    fault: bool
    """A fault (Xid, uncorrected ECC, pending retirement, a link that went down) rather than a
    degradation (throttling): only faults act."""


@dataclasses.dataclass(frozen=True)
class Signalled:
    signum: int


@dataclasses.dataclass(frozen=True)
class CycleEnded:
    """Another node ended this cycle (restart vote or shutdown) while this one watched."""


@dataclasses.dataclass(frozen=True)
class NeighbourGone:
    """The next node of the round stopped answering on its peer channel while the workers ran
    (`node_services.neighbour_watch`): lost with its workers, or gone after it finished."""

    node: str


@dataclasses.dataclass(frozen=True)
class NodesWaiting:
    count: int
    """Nodes that arrived after the round closed."""


@dataclasses.dataclass(frozen=True)
class StoreLost:
    error: str


@dataclasses.dataclass(frozen=True)
class StoreRestarted:
    """The store came back empty, and this node wrote back what it knew of the job."""


@dataclasses.dataclass(frozen=True)
class WorkersStopped:
    pass


@dataclasses.dataclass(frozen=True)
class ControlRequested:
    """A worker asked for a workload action (`ftrun.client_lib.WorkloadControlRequest`)."""

    rank: int
    action: WorkloadAction
    description: str
    by: str = ""
    """Who asked when it is no rank (a node service, e.g. the straggler detector)."""


@dataclasses.dataclass(frozen=True)
class PeersFinished:
    """Every node of the round reported success (or the exit barrier timed out)."""

    all_finished: bool = True
    """False: the exit barrier timed out before every node reported."""


@dataclasses.dataclass(frozen=True)
class RungFailed:
    """The in-process rung the policy chose for `event` could not be carried out (the ranks'
    store unreachable, a lost rank's process that would not start): decide it again without
    it."""

    event: WorkerEnded | HangsFound
    why: str


AgentEvent = (
    HealthChecked | JoinReady | Joined | JoinFailed | WorkersStarted | SpawnFailed | WorkerEnded
    | HangsFound | HealthFound | ControlRequested | Signalled | CycleEnded | NeighbourGone
    | NodesWaiting | StoreLost | StoreRestarted | WorkersStopped | PeersFinished | RungFailed
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the executor knows when it asks: this node, its cycle, the job's state in the store."""

    node: str
    cycle: int
    shutdown: Shutdown | None = None
    failures: int = 0
    """Failure restarts of the job so far (scale-ups do not count)."""
    round_size: int = 0
    max_nodes: int = 1
    after_stop: Outcome | None = None
    """While stopping: how this node ends after the stop (None: it restarts)."""
    stalled_cycles: int = 0
    """Cycles in a row before the joined round that made no progress."""
    progress_known: bool = False
    """The job reports iterations, so `stalled_cycles` says whether earlier cycles progressed."""
    history: tuple[FailureRecord, ...] = ()
    """The job's failures before this one (read for a failure of a running cycle)."""
    can_lose_node: bool = False
    """A standby node waits, or the round is above the job's minimum size."""
    ranks: range = range(0)
    """The global ranks this node holds in its cycle (read with the history)."""
    standby_waiting: int = 0
    """How many standby nodes wait to take a slot (read for a re-run request, a worker's exit
    16)."""
    suspects_standing_by: int = 0
    """Of those, the nodes that stepped aside for this cycle's re-run, which reached no verdict:
    they must not take the suspect slot back (read with `standby_waiting`)."""
    rerun_restarts: int = 0
    """Re-run restarts in a row just before this cycle's request that no verdict settled (read
    with `standby_waiting`)."""
    inprocess_wrapped: bool = False
    """This node's ranks run `ftrun.inprocess.Wrapper` in this cycle (read for a lost rank or a
    hang)."""
    inprocess_spent: str | None = None
    """Why the in-process restart budget allows no further restart this cycle (read with
    `inprocess_wrapped`); None: it allows one."""
    ended_for_rerun: bool = False
    """The cycle ended with a restart for a re-run elsewhere (read when another node ended it)."""
    finished_nodes: int = 0
    """Nodes of the cycle whose workers all exited 0 (read when a neighbour is gone)."""
