"""The `finalize` hook (NVRx's `inprocess.finalize`): bring the process back to a state where
the wrapped function can start again, after the fault was found and the process groups were
torn down, before the health check."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ftrun.aside import Aside
from ftrun.inprocess import exception
from ftrun.inprocess.state import FrozenState, Hook

log = logging.getLogger("ftrun.inprocess")


class Finalize(Hook):
    """Undo what the wrapped function left behind (globals, pending async work). An exception
    skips the health check and ends the process; compose several with `Compose`."""


class ThreadedFinalize(Finalize):
    """Runs `fn(*args, **kwargs)` in a daemon thread, at most `timeout`: a finalize stuck on a
    dead peer must not hang the restart (`exception.TimeoutError`; the thread is left behind,
    a daemon, since a thread cannot be killed).

    ftrun: works without CUDA (NVRx raises unless CUDA is initialized), takes the caller's
    current device rather than LOCAL_RANK's, and re-raises what `fn` raised (NVRx drops it).
    """

    def __init__(
        self, timeout: datetime.timedelta, fn: Callable[..., Any],
        args: tuple[Any, ...] | None = (), kwargs: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.timeout = timeout
        self.fn = fn
        self.args = tuple(args or ())
        self.kwargs = dict(kwargs or {})

    def __call__(self, state: FrozenState) -> FrozenState:
        # The device is per thread in CUDA: hand the caller's to the worker thread, so that fn
        # runs on the device this rank uses. Only if CUDA is already up: never initialize it.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            self.fn(*self.args, **self.kwargs)

        call = Aside(run, f"{type(self).__name__}-{state.rank}")
        if not call.done(self.timeout.total_seconds()):
            log.warning("%s: %r still running after %s", type(self).__name__, self.fn, self.timeout)
            raise exception.TimeoutError(f"finalize {self.fn!r} did not finish in {self.timeout}")
        call.result()
        return state
