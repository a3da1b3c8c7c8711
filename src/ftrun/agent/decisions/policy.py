"""The agent's decisions, apart from their effects: `decide(state, event, facts) -> Action`.

Pure: no store, no processes, no clock. The executor (`node.NodeAgent`) waits for the next
`AgentEvent` of its state, reads the `Facts` it needs from the store, asks `decide`, and applies
the `Action` (store writes, signals, the next state). Every restart, exit code, preemption and
budget decision of the agent is made here, once, and unit-tested without processes.

Rules worth knowing:
- A failure on this node votes for a restart of its cycle (the job-wide vote in
  `rendezvous.control` counts one failure per cycle however many nodes fail at once).
- A store that restarted empty (`ftrun store`, `--ft-store-reconnect-timeout`) ends the
  running cycle on every node: each writes back what it knew, and they meet in a fresh round.
- A shutdown request (preemption, budget spent, store lost) is job-wide and the first one wins:
  after asking, the node exits with the shutdown *in force*, which the executor reads back.
- A signal is preemption in every state: forwarded to the workers if any (they may checkpoint),
  then exit 75 (`ExitCode.PREEMPTED`), also after this node's workers finished.
- The job's last node to see every node finish shuts the job down with success, so standby
  nodes (hot spares) leave with 0 at once instead of waiting for a rendezvous timeout.
- A worker's control request ends the cycle: ExcludeThisNode makes this node leave for good
  (`ExitCode.EXCLUDED`, the others restart without it), ShutdownWorkload ends the job with
  `ExitCode.DO_NOT_RELAUNCH`; Continue changes nothing.
- A failure is named (`attribution.Signature`) and judged against the job's history of
  failures (`repeats.judge`): the same failure in `--ft-max-same-failure` cycles in a row stops
  the job with `ExitCode.REPEATED_FAILURE`, on one node or many; a node that failed the same
  way while holding other ranks, alone both times, leaves (if the job can go on without it);
  anything else restarts.
- A node gone while training (its ring neighbour's probes fail: `NeighbourGone`) is a failure
  that restarts the cycle, unless a node of the cycle already finished (then it may just have
  left): over NCCL the survivors' collectives would otherwise wait out torch's timeout.
- A health finding while training (`HealthFound`) does what `--ft-health-action` says: `log`,
  `restart` (a failure like any other), or `exclude` (the node leaves when the job can go on
  without it, else it is logged). Findings that are not faults (throttling) are only logged.
- The re-run state machine (`ftrun.rerun`): a worker's exit 16 asks for the step to be re-run
  on another node. It is not a failure: the job restarts (the suspect node steps aside, a
  standby takes its slot) when a standby node waits that is not itself a suspect of the re-run
  still undecided; otherwise every launcher exits 16 (a relaunch lands elsewhere). Bounded: a
  re-run asked for again in the next cycle, with no verdict between (the restart did not
  settle it), exits 16 too instead of restarting again (`RERUN_RESTARTS_IN_A_ROW`). A worker's
  exit 17 (a rejected result reproduced elsewhere, fatal) stops the job with 17, not
  relaunched.
- `--ft-max-no-progress-cycles`: a round that starts after that many cycles in a row without
  progress (see `rendezvous.published.Progress`) ends the job with `ExitCode.NO_PROGRESS`.
"""

from __future__ import annotations

import dataclasses
import signal

from ftrun.agent.decisions import ladder
from ftrun.agent.decisions.attribution import Signature, nvrx_stop, signal_name
from ftrun.agent.decisions.observed import (
    AgentEvent,
    ControlRequested,
    CycleEnded,
    Facts,
    HangsFound,
    HealthChecked,
    HealthFound,
    Joined,
    JoinFailed,
    JoinReady,
    NeighbourGone,
    NodesWaiting,
    Outcome,
    PeersFinished,
    RungFailed,
    Signalled,
    SpawnFailed,
    StoreLost,
    StoreRestarted,
    WorkerEnded,
    WorkersStarted,
    WorkersStopped,
)
from ftrun.agent.decisions.repeats import Decision, judge
from ftrun.agent.decisions.state import AgentState
from ftrun.errors import ExitCode
from ftrun.rank_monitor.workload import WorkloadAction

# ---- actions: what the executor does -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RestartVote:
    cause: str
    failure: bool = True
    """False for restarts that are not failures (scale-up): they do not spend the budget."""
    rerun: bool = False
    """A restart for a re-run elsewhere (exit 16): the job counts them (`rerun_restarts`)."""


@dataclasses.dataclass(frozen=True)
class InprocessInterrupt:
    """Interrupt the wrapped ranks' restart iteration (`agent.inprocess.link`)."""

    ranks: tuple[int, ...]
    cause: str


@dataclasses.dataclass(frozen=True)
class RankReplacement:
    """Start a lost wrapped rank's process again, alone, and interrupt the others' iteration
    (`agent.inprocess.effects.carry_out`)."""

    rank: int
    cause: str


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
    interrupt: InprocessInterrupt | None = None
    """The ladder's first rung: the wrapped ranks recover in-process (no stop, no vote). If
    their store cannot be reached, the executor asks again (`RungFailed`)."""
    replace: RankReplacement | None = None
    """The ladder's second rung: the survivors restart in-process, the lost rank's process is
    started again and joins them; if that cannot be done, the executor asks again
    (`RungFailed`)."""
    drain: bool = False
    """The workers leave on their own (a re-run's exit: every rank exits once its part of the
    checkpoint is saved): the stop waits for them, bounded, before it signals them."""
    record: Signature | None = None
    """A failure of this node to add to the job's history (and `failures.jsonl`)."""
    note: str | None = None
    """A decision worth a log line that changes nothing (a node that stays, a finding logged)."""

    def decision(self) -> tuple[str, str]:
        """What this action does about a failure, and why (for the events and failures.jsonl)."""
        if self.shutdown is not None:
            return "stop job", self.shutdown.reason
        if self.leave is not None:
            return "exclude node", self.leave
        return "restart", self.note or ""


KEEP_WATCHING = Action(None)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The decision table; `max_restarts` is the job's failure budget."""

    max_restarts: int
    max_no_progress_cycles: int = 0
    """<= 0: never stop for lack of progress."""
    max_same_failure: int = 3
    """<= 0: never stop for a failure that repeats in cycles in a row."""
    health_action: str = "exclude"
    """What a health fault found while training does: 'log', 'restart' or 'exclude'."""
    attribution_stop: str | None = None
    """NVRx's --ft-attribution-stop-action: with 'no-restart', a failure NVRx's attribution stops
    on (`attribution.nvrx_stop`) stops the job at once; with 'log', that is logged."""

    def decide(self, state: AgentState, event: AgentEvent, facts: Facts) -> Action:
        if isinstance(event, Signalled):
            return self._signalled(state, event, facts)
        if isinstance(event, StoreLost):
            return self._store_lost(state, facts)
        if isinstance(event, StoreRestarted):
            return _store_restarted(state)
        handler = _HANDLERS.get((state, type(event)))
        if handler is None:
            raise ValueError(f"no decision for {type(event).__name__} in state {state.value}")
        return handler(self, event, facts)

    # ---- per state -----------------------------------------------------------------------

    def _health(self, event: HealthChecked, facts: Facts) -> Action:
        if event.problem is None:
            return Action(AgentState.RENDEZVOUS)
        unhealthy = _exit(event.code, f"node unhealthy: {event.problem}")
        return dataclasses.replace(unhealthy, report_unhealthy=event.problem)

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
        if event.returncode in RERUN_CODES:
            return _rerun(event, facts)
        if event.returncode != 0:
            cause = f"rank {event.rank} on {facts.node} {exit_text(event.returncode)}"
            rung = ladder.for_lost_rank(facts.inprocess_wrapped, event.returncode,
                                        facts.inprocess_spent)  # fmt: skip
            if rung.rung is ladder.Rung.REPLACE_RANK:
                return Action(None, replace=RankReplacement(event.rank, cause))
            failure = self._failure(cause, event.signature, facts)
            note = f"{rung.why}: in-job restart" if facts.inprocess_wrapped else failure.note
            return dataclasses.replace(failure, note=note)
        return KEEP_WATCHING if event.others_running else Action(AgentState.SUCCEEDED)

    def _hangs(self, event: HangsFound, facts: Facts) -> Action:
        ranks = ", ".join(str(r) for r in event.ranks)
        cause = f"rank(s) {ranks} on {facts.node} hung ({event.kind})"
        rung = ladder.for_hang(facts.inprocess_wrapped, event.stopped, facts.inprocess_spent)
        if rung.rung is ladder.Rung.IN_PROCESS:
            return Action(None, interrupt=InprocessInterrupt(event.ranks, cause))
        failure = self._failure(cause, event.signature, facts)
        note = f"{rung.why}: in-job restart" if facts.inprocess_wrapped else failure.note
        return dataclasses.replace(failure, kill=event.pids, note=note)

    def _rung_failed(self, event: RungFailed, facts: Facts) -> Action:
        """The in-process rung could not be taken: the in-job restart, as if the ranks did not
        wrap."""
        unwrapped = dataclasses.replace(facts, inprocess_wrapped=False)
        action = self.decide(AgentState.RUNNING, event.event, unwrapped)
        note = f"in-process: {event.why}: in-job restart"
        return dataclasses.replace(action, note=f"{note}; {action.note}" if action.note else note)

    def _health_found(self, event: HealthFound, facts: Facts) -> Action:
        found = f"health on {facts.node}: {event.signature.describe()}"
        if not event.fault or self.health_action == "log":
            return Action(None, note=found)
        if self.health_action == "restart" or facts.can_lose_node:
            return self._failure(found, event.signature, facts, exclude_now=True)
        return Action(None, note=f"{found}; the node stays: no standby node waits and the job "
                                 "is at its minimum size")  # fmt: skip

    def _failure(
        self, cause: str, signature: Signature | None, facts: Facts, exclude_now: bool = False
    ) -> Action:
        """A failure of this node: restart, or, judged against the job's history, leave or
        stop the job. `exclude_now`: the failure itself asks for the node to leave (a health
        fault under --ft-health-action=exclude). One NVRx's attribution stops on stops the job
        under --ft-attribution-stop-action=no-restart, and is logged as such under log."""
        if signature is None:
            return _restart(cause)
        cause = f"{cause}: {signature.key}"
        stop = nvrx_stop(signature)
        if stop and self.attribution_stop == "no-restart":
            why = (f"{cause}: {stop}, which NVRx's attribution stops on "
                   "(--ft-attribution-stop-action=no-restart)")  # fmt: skip
            done = Outcome(ExitCode.REPEATED_FAILURE, why)
            return Action(AgentState.STOPPING, record=signature, shutdown=done)
        action = self._judged(cause, signature, facts, exclude_now)
        if stop and self.attribution_stop == "log" and action.shutdown is None:
            logged = (f"NVRx's attribution would stop the job here ({stop}); only logged: "
                      "--ft-attribution-stop-action=log")  # fmt: skip
            action = dataclasses.replace(action, note=f"{action.note}; {logged}"
                                         if action.note else logged)  # fmt: skip
        return action

    def _judged(self, cause: str, signature: Signature, facts: Facts, exclude_now: bool) -> Action:
        """`_failure`'s judgement against the job's history (`repeats.judge`)."""
        stalled = facts.stalled_cycles if facts.progress_known else None
        found = judge(signature, facts.node, facts.cycle, facts.history, self.max_same_failure,
                      facts.can_lose_node, facts.ranks, stalled)  # fmt: skip
        if found.decision is Decision.STOP:
            done = Outcome(ExitCode.REPEATED_FAILURE, found.reason)
            return Action(AgentState.STOPPING, record=signature, shutdown=done)
        if found.decision is Decision.EXCLUDE or (exclude_now and self.health_action == "exclude"):
            why = found.reason or f"node {facts.node} excluded: {signature.key}"
            return Action(
                AgentState.STOPPING, record=signature, leave=why, vote=RestartVote(why),
                outcome=Outcome(ExitCode.EXCLUDED, why),
            )  # fmt: skip
        return Action(
            AgentState.STOPPING, record=signature, vote=RestartVote(cause),
            note=found.reason or None,
        )  # fmt: skip

    def _control(self, event: ControlRequested, facts: Facts) -> Action:
        asked = f"{event.by or f'rank {event.rank}'} on {facts.node} asked to"
        if event.action is WorkloadAction.ExcludeThisNode:
            why = f"{asked} exclude its node: {event.description}"
            return Action(AgentState.STOPPING, leave=why, vote=RestartVote(why, failure=False),
                          outcome=Outcome(ExitCode.EXCLUDED, why))  # fmt: skip
        if event.action is WorkloadAction.ShutdownWorkload:
            why = f"{asked} shut the workload down: {event.description}"
            return Action(AgentState.STOPPING, shutdown=Outcome(ExitCode.DO_NOT_RELAUNCH, why))
        return KEEP_WATCHING  # Continue: the executor logs it

    def _neighbour_gone(self, event: NeighbourGone, facts: Facts) -> Action:
        gone = f"node {event.node} stopped answering while {facts.node}'s workers ran"
        if facts.finished_nodes:  # the job is finishing: a node done with it may leave
            return Action(None, note=f"{gone}; the cycle's nodes are finishing, it stays")
        return _restart(f"{gone} (lost with its workers)")

    def _cycle_ended(self, _event: CycleEnded, facts: Facts) -> Action:
        """Another node ended the cycle: follow it into a restart, or out with the shutdown.
        For a re-run, this node's ranks are leaving too, each once its checkpoint part is
        saved: they are let go (drain), not killed mid-save."""
        shutdown = facts.shutdown
        rerun = facts.ended_for_rerun or (shutdown is not None and shutdown.code in RERUN_CODES)
        outcome = None if shutdown is None else Outcome(shutdown.code, shutdown.reason)
        return Action(AgentState.STOPPING, outcome=outcome, drain=rerun)

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
        sig = signal.Signals(event.signum)
        ask = Outcome(ExitCode.PREEMPTED, f"{sig.name} on node {facts.node}")
        if state in (AgentState.RUNNING, AgentState.STARTING):
            # Forwarded: the workers may checkpoint before they go.
            return Action(AgentState.STOPPING, shutdown=ask, stop_signal=sig)
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


def _store_restarted(state: AgentState) -> Action:
    """The store restarted empty (`ftrun store`), and this node wrote back what it knew: the
    job is in a fresh cycle already, so no vote. Running workers stop, and every node meets
    again; a step the store's loss interrupted is made again."""
    if state in (AgentState.RUNNING, AgentState.STARTING):
        return Action(AgentState.STOPPING)
    return KEEP_WATCHING  # health check, rendezvous, stopping, succeeded: the same step again


RERUN_CODES = (ExitCode.RESUME_TO_DISAMBIGUATE, ExitCode.FAILED_ON_RESULT_VALIDATION)
RERUN_RESTARTS_IN_A_ROW = 1
"""Re-run restarts in a row, with no verdict between, after which a re-run asked for again
exits 16 instead: the restart did not settle it (the step landed on the suspect GPU again, or
its checkpoint did not reach the re-run), and restarts that are not failures would never end."""


def _rerun(event: WorkerEnded, facts: Facts) -> Action:
    """The re-run state machine's exits: re-run elsewhere (16), or the diagnosis is done (17)."""
    who = f"rank {event.rank} on {facts.node}"
    # Every rank exits with the code, once its part of the checkpoint is saved: drain.
    if event.returncode == ExitCode.FAILED_ON_RESULT_VALIDATION:
        why = f"{who}: a rejected result was reproduced on another node (fatal): stopping"
        return Action(AgentState.STOPPING, drain=True,
                      shutdown=Outcome(ExitCode.FAILED_ON_RESULT_VALIDATION, why))  # fmt: skip
    able = facts.standby_waiting - facts.suspects_standing_by
    if able > 0 and facts.rerun_restarts < RERUN_RESTARTS_IN_A_ROW:
        why = f"{who}: a rejected result is re-run on another node"
        vote = RestartVote(why, failure=False, rerun=True)
        return Action(AgentState.STOPPING, vote=vote, drain=True)
    if able > 0:
        blocker = (f"it was asked for in {facts.rerun_restarts + 1} cycles in a row with no "
                   "verdict")  # fmt: skip
    elif facts.standby_waiting:
        blocker = "the only standby nodes are suspects of the re-run still undecided"
    else:
        blocker = "no standby node waits"
    why = (f"{who}: a rejected result must be re-run on other GPUs and {blocker}: "
           "relaunch the job from its checkpoint")  # fmt: skip
    relaunch = Outcome(ExitCode.RESUME_TO_DISAMBIGUATE, why)
    return Action(AgentState.STOPPING, shutdown=relaunch, drain=True)


def _exit(code: ExitCode, reason: str) -> Action:
    return Action(AgentState.EXITING, outcome=Outcome(code, reason))


def _restart(cause: str) -> Action:
    return Action(AgentState.STOPPING, vote=RestartVote(cause))


def exit_text(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL'."""
    return f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"


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
    (_S.RUNNING, RungFailed): Policy._rung_failed,
    (_S.RUNNING, HealthFound): Policy._health_found,
    (_S.RUNNING, ControlRequested): Policy._control,
    (_S.RUNNING, CycleEnded): Policy._cycle_ended,
    (_S.RUNNING, NeighbourGone): Policy._neighbour_gone,
    (_S.RUNNING, NodesWaiting): Policy._nodes_waiting,
    (_S.STOPPING, WorkersStopped): Policy._stopped,
    (_S.SUCCEEDED, PeersFinished): Policy._peers_finished,
    (_S.SUCCEEDED, CycleEnded): Policy._cycle_ended_after_success,
}
