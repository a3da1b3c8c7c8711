"""The `initialize` hook run at the start of every restart iteration (NVRx's
`inprocess.initialize`), and `RetryController`, the usual restart budget."""

from __future__ import annotations

from ftrun.inprocess import exception
from ftrun.inprocess.state import FrozenState, Hook


class Initialize(Hook):
    """Runs at the start of every iteration, the first included. An `Exception` it raises
    starts another restart; a `BaseException` (`RestartAbort`) ends the wrapper."""


class RetryController(Initialize):
    """Stops restarting (`RestartAbort`) once `max_iterations` iterations have started
    (None: no limit) or the world or active world shrank below its minimum.

    ftrun: an active world size not yet assigned (None) is no shortfall (NVRx: a TypeError).
    """

    def __init__(self, max_iterations: int | None = None, min_world_size: int = 1,
                 min_active_world_size: int = 1) -> None:  # fmt: skip
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: FrozenState) -> FrozenState:
        reasons = []
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            reasons.append(f"iteration {state.iteration} >= max_iterations {self.max_iterations}")
        if state.world_size < self.min_world_size:
            reasons.append(f"world size {state.world_size} < {self.min_world_size}")
        # Before the first rank assignment the active world size is unknown: not a shortfall.
        active = state.active_world_size
        if active is not None and active < self.min_active_world_size:
            reasons.append(f"active world size {active} < {self.min_active_world_size}")
        if reasons:
            raise exception.RestartAbort("; ".join(reasons))
        return state
