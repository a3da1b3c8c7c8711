"""Exceptions of the in-process restart wrapper (NVRx's `inprocess.exception`).

`RestartError` and its subclasses end one restart iteration; `RestartAbort` is a
`BaseException` so that no `except Exception` in user code can swallow the decision to stop.
`TimeoutError` shadows the builtin on purpose (NVRx's name); import the module, not the name.
"""

from __future__ import annotations


class RestartError(Exception):
    """Base of the errors the wrapper raises; a restart may still follow."""


class RestartAbort(BaseException):
    """Stop restarting now: the wrapper gives up and re-raises (not a failure of the wrapper)."""


class HealthCheckError(RestartError):
    """A health check failed: this rank must not take part in the restart."""


class InternalError(RestartError):
    """The wrapper itself broke an invariant (a bug, not the workload's fault)."""


class TimeoutError(RestartError):  # shadows the builtin: NVRx's public name
    """A bounded step (abort, finalize, health check, barrier) did not finish in time."""
