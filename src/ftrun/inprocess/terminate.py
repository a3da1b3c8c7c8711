"""The `global_finalize_failure` hook (NVRx's `inprocess.terminate`)."""

from __future__ import annotations

import abc

from ftrun.inprocess.state import FrozenState


class Terminate(abc.ABC):
    """Runs on a rank that was not terminated when the wrapper gives up on it (restart budget
    spent, `RestartAbort`, ...); compose several with `Compose`."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Do the work and return `state` unchanged (the next composed stage gets it)."""
        raise NotImplementedError
