"""The checkpointing subsystem's exceptions: one hierarchy under `CheckpointError`.

Every message is one line that names the file (or the path inside the state) and what is wrong,
so a log line alone tells an operator which part to look at.
"""

from __future__ import annotations

from ftrun.errors import ExitCode, FtrunError


class CheckpointError(FtrunError):
    """Base of every checkpointing error."""


class CheckpointUsageError(CheckpointError, ValueError):
    """An argument is invalid (negative iteration, replication parameters, session id)."""

    exit_code = ExitCode.USAGE


class CheckpointFormatError(CheckpointError, TypeError):
    """A value in the state cannot be stored without pickle; the message names where it is."""


class CheckpointWriteError(CheckpointError):
    """A part could not be written (disk full, permissions); no partial part is left behind."""


class CheckpointCorruptError(CheckpointError):
    """A stored part is truncated, altered or not in our format; it must not be used."""


class CheckpointNotFoundError(CheckpointError):
    """No complete, readable checkpoint exists where one was asked for."""
