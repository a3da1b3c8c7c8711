"""The agent's lifecycle: states and the one table of legal moves.

HEALTH_CHECK -> RENDEZVOUS -> STARTING -> RUNNING -> STOPPING -> HEALTH_CHECK (restart)
                                                 \\-> SUCCEEDED -> EXITING -> EXITED
any of HEALTH_CHECK, RENDEZVOUS, STOPPING, SUCCEEDED -> EXITING (give up, shutdown)
"""

from __future__ import annotations

import enum


class AgentState(str, enum.Enum):
    HEALTH_CHECK = "health_check"
    RENDEZVOUS = "rendezvous"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    EXITING = "exiting"
    EXITED = "exited"


TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    AgentState.HEALTH_CHECK: frozenset({AgentState.RENDEZVOUS, AgentState.EXITING}),
    AgentState.RENDEZVOUS: frozenset({AgentState.STARTING, AgentState.EXITING}),
    AgentState.STARTING: frozenset({AgentState.RUNNING, AgentState.STOPPING}),
    AgentState.RUNNING: frozenset({AgentState.STOPPING, AgentState.SUCCEEDED}),
    AgentState.STOPPING: frozenset({AgentState.HEALTH_CHECK, AgentState.EXITING}),
    AgentState.SUCCEEDED: frozenset({AgentState.EXITING, AgentState.HEALTH_CHECK}),
    AgentState.EXITING: frozenset({AgentState.EXITED}),
    AgentState.EXITED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A move the table does not allow: a bug in the agent."""


def check_transition(current: AgentState, new: AgentState) -> AgentState:
    if new not in TRANSITIONS[current]:
        raise IllegalTransitionError(f"agent cannot go from {current.value} to {new.value}")
    return new
