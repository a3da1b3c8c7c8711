"""The agent's decisions, apart from their effects: `decide(state, event, facts) -> Action`.

Pure: no store, no processes, no clock. The executor (`node.NodeAgent`) waits for the next
`AgentEvent` of its state, reads the `Facts` it needs from the store, asks `decide`, and applies
the `Action` (store writes, signals, the next state). Every restart, exit code, preemption and
budget decision of the agent is made here, once, and unit-tested without processes.

Rules worth knowing:
- A failure on this node votes for a restart of its cycle (the job-wide vote in
  `rendezvous.control` counts one failure per cycle however many nodes fail at once).
- A shutdown request (preemption, budget spent, store lost) is job-wide and the first one wins:
  after asking, the node exits with the shutdown *in force*, which the executor reads back.
- A signal is preemption in every state: forwarded to the workers if any (they may checkpoint),
  then exit 75 (`ExitCode.PREEMPTED`), also after this node's workers finished.
- The job's last node to see every node finish shuts the job down with success, so standby
  nodes (hot spares) leave with 0 at once instead of waiting for a rendezvous timeout.
- A worker's control request ends the cycle: ExcludeThisNode makes this node leave for good
  (`ExitCode.EXCLUDED`, the others restart without it), ShutdownWorkload ends the job with
  `ExitCode.DO_NOT_RELAUNCH`; Continue changes nothing.
- `--ft-max-no-progress-cycles`: a round that starts after that many cycles in a row without
  progress (see `rendezvous.published.Progress`) ends the job with `ExitCode.NO_PROGRESS`.
"""

from __future__ import annotations

import dataclasses
import signal

from ftrun.agent.state import AgentState
from ftrun.errors import ExitCode
from ftrun.rank_monitor.workload import WorkloadAction
from ftrun.rendezvous.control import Shutdown


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How this launcher ends: its exit code and the reason logged with it."""

    code: ExitCode
    reason: str


# ---- events: what the executor observed --------------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class HangsFound:
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    """The hung workers' process group leaders: killed at once (they cannot be asked)."""
    kind: str


@dataclasses.dataclass(frozen=True)
class Signalled:
    signum: int


@dataclasses.dataclass(frozen=True)
class CycleEnded:
    """Another node ended this cycle (restart vote or shutdown) while this one watched."""


@dataclasses.dataclass(frozen=True)
class NodesWaiting:
    count: int
    """Nodes that arrived after the round closed."""


@dataclasses.dataclass(frozen=True)
class StoreLost:
    error: str


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


AgentEvent = (
    HealthChecked
    | JoinReady
    | Joined
    | JoinFailed
    | WorkersStarted
    | SpawnFailed
    | WorkerEnded
    | HangsFound
    | ControlRequested
    | Signalled
    | CycleEnded
    | NodesWaiting
    | StoreLost
    | WorkersStopped
    | PeersFinished
)


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


# ---- actions: what the executor does -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RestartVote:
    cause: str
    failure: bool = True
    """False for restarts that are not failures (scale-up): they do not spend the budget."""


@dataclasses.dataclass(frozen=True)
class Action:
    """The next state, and the effects that go with the move, applied in field order."""

    next_state: AgentState | None
    """None: stay in the current state and keep watching."""
    report_unhealthy: str | None = None
    leave: str | None = None
    """This node leaves the job for good (why): rounds stop keeping its slot."""
    kill: tuple[int, ...] = ()
    """Process groups to SIGKILL at once."""
    vote: RestartVote | None = None
    shutdown: Outcome | None = None
    """Ask every agent to end the job; this node then ends with the shutdown in force."""
    outcome: Outcome | None = None
    """How this node ends (EXITING now, or after STOPPING); None with STOPPING: restart."""
    stop_signal: signal.Signals | None = None
    """The signal that stops the workers; None: the configured termination signal."""


KEEP_WATCHING = Action(None)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The decision table; `max_restarts` is the job's failure budget."""

    max_restarts: int
    max_no_progress_cycles: int = 0
    """<= 0: never stop for lack of progress."""

    def decide(self, state: AgentState, event: AgentEvent, facts: Facts) -> Action:
        if isinstance(event, Signalled):
            return self._signalled(state, event, facts)
        if isinstance(event, StoreLost):
            return self._store_lost(state, facts)
        handler = _HANDLERS.get((state, type(event)))
        if handler is None:
            raise ValueError(f"no decision for {type(event).__name__} in state {state.value}")
        return handler(self, event, facts)

    # ---- per state -----------------------------------------------------------------------

    def _health(self, event: HealthChecked, facts: Facts) -> Action:
        if event.problem is None:
            return Action(AgentState.RENDEZVOUS)
        reason = f"node unhealthy: {event.problem}"
        return Action(
            AgentState.EXITING,
            report_unhealthy=event.problem,
            outcome=Outcome(event.code, reason),
        )

    def _before_join(self, _event: JoinReady, facts: Facts) -> Action:
        if facts.shutdown is not None:
            return _exit(facts.shutdown.code, facts.shutdown.reason)
        if facts.failures > self.max_restarts:
            reason = (
                f"restart budget spent ({facts.failures} failures, "
                f"--max-restarts={self.max_restarts})"
            )
            return Action(AgentState.EXITING, shutdown=Outcome(ExitCode.FAILED, reason))
        return KEEP_WATCHING  # go on and join

    def _joined(self, _event: Joined, facts: Facts) -> Action:
        limit = self.max_no_progress_cycles
        if 0 < limit <= facts.stalled_cycles:
            reason = (
                f"{facts.stalled_cycles} cycles in a row made no progress (no rank reported an "
                f"iteration past the job's best; --ft-max-no-progress-cycles={limit})"
            )
            return Action(AgentState.EXITING, shutdown=Outcome(ExitCode.NO_PROGRESS, reason))
        return Action(AgentState.STARTING)

    def _join_failed(self, event: JoinFailed, facts: Facts) -> Action:
        if event.closed and facts.shutdown is not None:
            return _exit(facts.shutdown.code, facts.shutdown.reason)
        return _exit(event.code, event.reason)

    def _started(self, _event: WorkersStarted, _facts: Facts) -> Action:
        return Action(AgentState.RUNNING)

    def _spawn_failed(self, event: SpawnFailed, facts: Facts) -> Action:
        return _restart(f"spawn failed on {facts.node}: {event.reason}")

    def _worker_ended(self, event: WorkerEnded, facts: Facts) -> Action:
        if event.returncode != 0:
            return _restart(f"rank {event.rank} on {facts.node} {exit_text(event.returncode)}")
        return KEEP_WATCHING if event.others_running else Action(AgentState.SUCCEEDED)

    def _hangs(self, event: HangsFound, facts: Facts) -> Action:
        ranks = ", ".join(str(r) for r in event.ranks)
        cause = f"rank(s) {ranks} on {facts.node} hung ({event.kind})"
        return dataclasses.replace(_restart(cause), kill=event.pids)

    def _control(self, event: ControlRequested, facts: Facts) -> Action:
        asked = f"{event.by or f'rank {event.rank}'} on {facts.node} asked to"
        if event.action is WorkloadAction.ExcludeThisNode:
            why = f"{asked} exclude its node: {event.description}"
            return Action(
                AgentState.STOPPING,
                leave=why,
                vote=RestartVote(why, failure=False),
                outcome=Outcome(ExitCode.EXCLUDED, why),
            )
        if event.action is WorkloadAction.ShutdownWorkload:
            why = f"{asked} shut the workload down: {event.description}"
            return Action(AgentState.STOPPING, shutdown=Outcome(ExitCode.DO_NOT_RELAUNCH, why))
        return KEEP_WATCHING  # Continue: the executor logs it

    def _cycle_ended(self, _event: CycleEnded, facts: Facts) -> Action:
        """Another node ended the cycle: follow it into a restart, or out with the shutdown."""
        if facts.shutdown is None:
            return Action(AgentState.STOPPING)
        return Action(
            AgentState.STOPPING, outcome=Outcome(facts.shutdown.code, facts.shutdown.reason)
        )

    def _cycle_ended_after_success(self, _event: CycleEnded, facts: Facts) -> Action:
        if facts.shutdown is not None:
            return _exit(facts.shutdown.code, facts.shutdown.reason)
        return Action(AgentState.HEALTH_CHECK)  # another node failed after this one finished

    def _nodes_waiting(self, event: NodesWaiting, facts: Facts) -> Action:
        if event.count > 0 and facts.round_size < facts.max_nodes:
            return Action(None, vote=RestartVote("a new node is waiting", failure=False))
        return KEEP_WATCHING

    def _stopped(self, _event: WorkersStopped, facts: Facts) -> Action:
        if facts.after_stop is not None:
            return Action(AgentState.EXITING, outcome=facts.after_stop)
        return Action(AgentState.HEALTH_CHECK)

    def _peers_finished(self, event: PeersFinished, _facts: Facts) -> Action:
        done = Outcome(ExitCode.SUCCESS, "all workers finished")
        if not event.all_finished:
            return Action(AgentState.EXITING, outcome=done)
        # Ends the job for the standby nodes too (the first request wins: a preemption that
        # came first stays in force, and this node exits with it).
        return Action(AgentState.EXITING, shutdown=done)

    # ---- in every state ------------------------------------------------------------------

    def _signalled(self, state: AgentState, event: Signalled, facts: Facts) -> Action:
        """Preemption: the job ends with 75 (relaunch me), wherever this node was."""
        name = signal.Signals(event.signum).name
        ask = Outcome(ExitCode.PREEMPTED, f"{name} on node {facts.node}")
        if state in (AgentState.RUNNING, AgentState.STARTING):
            # Forwarded: the workers may checkpoint before they go.
            return Action(
                AgentState.STOPPING, shutdown=ask, stop_signal=signal.Signals(event.signum)
            )
        if state is AgentState.STOPPING:
            return Action(None, shutdown=ask)  # already stopping: end with the shutdown after
        return Action(AgentState.EXITING, shutdown=ask)

    def _store_lost(self, state: AgentState, facts: Facts) -> Action:
        lost = Outcome(ExitCode.FAILED, "rendezvous store lost")
        if state is AgentState.STOPPING:
            return Action(None, outcome=lost)  # finish the stop, then leave
        if state in (AgentState.RUNNING, AgentState.STARTING):
            return Action(AgentState.STOPPING, outcome=lost)
        return Action(AgentState.EXITING, outcome=lost)


def _exit(code: ExitCode, reason: str) -> Action:
    return Action(AgentState.EXITING, outcome=Outcome(code, reason))


def _restart(cause: str) -> Action:
    return Action(AgentState.STOPPING, vote=RestartVote(cause))


def exit_text(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_S = AgentState
_HANDLERS = {
    (_S.HEALTH_CHECK, HealthChecked): Policy._health,
    (_S.RENDEZVOUS, JoinReady): Policy._before_join,
    (_S.RENDEZVOUS, Joined): Policy._joined,
    (_S.RENDEZVOUS, JoinFailed): Policy._join_failed,
    (_S.STARTING, WorkersStarted): Policy._started,
    (_S.STARTING, SpawnFailed): Policy._spawn_failed,
    (_S.RUNNING, WorkerEnded): Policy._worker_ended,
    (_S.RUNNING, HangsFound): Policy._hangs,
    (_S.RUNNING, ControlRequested): Policy._control,
    (_S.RUNNING, CycleEnded): Policy._cycle_ended,
    (_S.RUNNING, NodesWaiting): Policy._nodes_waiting,
    (_S.STOPPING, WorkersStopped): Policy._stopped,
    (_S.SUCCEEDED, PeersFinished): Policy._peers_finished,
    (_S.SUCCEEDED, CycleEnded): Policy._cycle_ended_after_success,
}
