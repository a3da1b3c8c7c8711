"""Status lines for a nested restarter (NVRx's `inprocess.nested_restarter`).

When in-process restarts run inside in-job restarts, the outer tooling follows the inner
restarter's progress from log lines of the form

    [NestedRestarter] name=[InProcess] state=<state>[ stage=<stage>]

written by one rank (`special_rank`, an initial rank). Pass the callbacks to the wrapper's
hooks: `NestedRestarterHandlingCompleted` as (part of) `initialize`,
`NestedRestarterHandlingStarting` in `abort`, `NestedRestarterFinalized` as
`completion`, `NestedRestarterAborted` as `terminate`.

ftrun: the lines go through `logging.getLogger("ftrun.inprocess")` at INFO (NVRx: a
dedicated logger that always prints them to stdout); a logger with NVRx's
`log_for_restarter` method is used through that method.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ftrun.inprocess.abort import Abort
from ftrun.inprocess.completion import Completion
from ftrun.inprocess.initialize import Initialize
from ftrun.inprocess.state import FrozenState
from ftrun.inprocess.terminate import Terminate

LOGGER_NAME = "ftrun.inprocess"


@dataclasses.dataclass
class NestedRestarterCallback:
    """Writes one status line when the state's initial rank is `special_rank`."""

    restarter_state: str
    restarter_stage: str | None = None
    logger: Any = dataclasses.field(default_factory=lambda: logging.getLogger(LOGGER_NAME))
    special_rank: int = 0

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.initial_rank == self.special_rank:
            line = f"[NestedRestarter] name=[InProcess] state={self.restarter_state}"
            if self.restarter_stage is not None:
                line += f" stage={self.restarter_stage}"
            emit = getattr(self.logger, "log_for_restarter", None) or self.logger.info
            emit(line)
        return state


class NestedRestarterHandlingCompleted(NestedRestarterCallback, Initialize):
    """An `Initialize`: `state=initialize` at the first iteration, then
    `state=handling stage=completed` at every restart."""

    def __init__(self, special_rank: int = 0) -> None:
        super().__init__(restarter_state="initialize", special_rank=special_rank)
        self._called_once = False

    def __call__(self, state: FrozenState) -> FrozenState:
        state = super().__call__(state)
        if not self._called_once:
            self._called_once = True
            self.restarter_state, self.restarter_stage = "handling", "completed"
        return state


@dataclasses.dataclass
class NestedRestarterHandlingStarting(NestedRestarterCallback, Abort):
    """An `Abort`: `state=handling stage=starting` when a fault is being handled."""

    restarter_state: str = "handling"
    restarter_stage: str | None = "starting"


@dataclasses.dataclass
class NestedRestarterFinalized(NestedRestarterCallback, Completion):
    """A `Completion`: `state=finalized` when the wrapped function completed."""

    restarter_state: str = "finalized"


@dataclasses.dataclass
class NestedRestarterAborted(NestedRestarterCallback, Terminate):
    """A `Terminate`: `state=aborted` when the wrapper gave up."""

    restarter_state: str = "aborted"
