"""Which worker commands a fork server can run: `python -u [-m] target args...` with the
launcher's own interpreter. Anything else (`--no-python`, another `PYTHON_EXEC`) is spawned."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PythonTarget:
    """A worker command that the fork server can run: `python -u [-m] target args...`."""

    module: bool
    target: str
    args: tuple[str, ...]


def python_target(entrypoint: Sequence[str]) -> PythonTarget | None:
    """The script or module of a `python -u ...` entrypoint; None for anything else."""
    if len(entrypoint) < 3 or entrypoint[0] != sys.executable or entrypoint[1] != "-u":
        return None
    if entrypoint[2] == "-m":
        return (
            PythonTarget(True, entrypoint[3], tuple(entrypoint[4:]))
            if len(entrypoint) > 3
            else None
        )
    if entrypoint[2].startswith("-"):
        return None
    return PythonTarget(False, entrypoint[2], tuple(entrypoint[3:]))
