"""The `global_finalize_success` hook (NVRx's `inprocess.completion`)."""

from __future__ import annotations

import abc

from ftrun.inprocess.state import FrozenState


class Completion(abc.ABC):
    """Runs on every rank that was not terminated once the wrapped function has completed;
    compose several with `Compose`."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Do the work and return `state` unchanged (the next composed stage gets it)."""
        raise NotImplementedError
