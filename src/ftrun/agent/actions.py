"""What the executor does after a decision (`policy.Policy.decide`): the next state and the
effects that go with the move. Data only: `node.NodeAgent` applies them."""

from __future__ import annotations

import dataclasses
import signal

from ftrun.agent.diagnosis.attribution import Signature
from ftrun.agent.observed import Outcome
from ftrun.agent.state import AgentState


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
    """Start a lost wrapped rank's process again, alone (`NodeAgent._replace_rank`)."""

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
    their store cannot be reached, the executor asks again as if they did not wrap."""
    replace: RankReplacement | None = None
    """The ladder's second rung: the survivors restart in-process, the lost rank's process is
    started again and joins them; if that cannot be done, the executor asks again as if the
    ranks did not wrap."""
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
