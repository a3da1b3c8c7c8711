"""The `global_finalize_failure` hook (NVRx's `inprocess.terminate`)."""

from __future__ import annotations

from ftrun.inprocess.state import Hook


class Terminate(Hook):
    """Runs on a rank that was not terminated when the wrapper gives up on it (restart budget
    spent, `RestartAbort`, ...); compose several with `Compose`."""
