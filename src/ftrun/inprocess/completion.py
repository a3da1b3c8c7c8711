"""The `global_finalize_success` hook (NVRx's `inprocess.completion`)."""

from __future__ import annotations

from ftrun.inprocess.state import Hook


class Completion(Hook):
    """Runs on every rank that was not terminated once the wrapped function has completed;
    compose several with `Compose`."""
