"""The Lightning integration's exceptions: one hierarchy under `LightningIntegrationError`."""

from __future__ import annotations

from ftrun.errors import ExitCode, FtrunError


class LightningIntegrationError(FtrunError):
    """Base of every ftrun.lightning error."""


class LightningUsageError(LightningIntegrationError, ValueError):
    """A callback or plugin argument is invalid; the message names it and what was given."""

    exit_code = ExitCode.USAGE


class SimulatedFaultError(LightningIntegrationError):
    """Raised on purpose by `SimulatedFault(kind="exception")` (tests and demos)."""
