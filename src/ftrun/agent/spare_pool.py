"""The agent's side of pre-started workers (see `spare.py`): start, hand out, dispose."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from ftrun.agent.termination import die_with_parent


@dataclasses.dataclass(frozen=True)
class PythonTarget:
    """A worker command that a spare can run: `python -u [-m] target args...`."""

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


def spawn_process(
    argv: Sequence[str], env: Mapping[str, str], stdin: int
) -> subprocess.Popen[bytes]:
    """Start a worker-to-be: own process group, dies with the agent, output piped."""
    return subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        # Only a prctl() through a preloaded libc: nothing that takes a lock after fork.
        preexec_fn=die_with_parent,  # noqa: PLW1509
    )


class SparePool:
    """One pre-started process per local rank, importing `modules` while the job runs."""

    def __init__(
        self, target: PythonTarget, modules: Sequence[str], env: Mapping[str, str]
    ) -> None:
        self._target = target
        self._argv = [sys.executable, "-u", "-m", "ftrun.agent.spare", *modules]
        self._env = dict(env)
        self._spares: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self._spares.values()}

    def fill(self, local_ranks: int) -> None:
        for local_rank in range(local_ranks):
            spare = self._spares.get(local_rank)
            if spare is None or spare.poll() is not None:
                self._spares[local_rank] = spawn_process(self._argv, self._env, subprocess.PIPE)

    def start(
        self, local_rank: int, env: Mapping[str, str], announce: Callable[[int], None]
    ) -> subprocess.Popen[bytes] | None:
        """Turn the spare of `local_rank` into the worker; None when it has none alive.

        `announce(pid)` runs before the spare gets its job: a pre-imported worker registers
        with the monitor within milliseconds, and must find itself expected there.
        Without a spare the caller spawns the worker directly: a fresh spare would import
        every pre-warm module, which is slower than the script importing what it needs.
        """
        proc = self._spares.pop(local_rank, None)
        if proc is None or proc.poll() is not None:
            return None
        announce(proc.pid)
        job = {
            "module": self._target.module,
            "target": self._target.target,
            "args": list(self._target.args),
            "env": dict(env),
            "cwd": os.getcwd(),
        }
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(job).encode() + b"\n")
        proc.stdin.close()
        return proc

    def close(self) -> None:
        """Dispose of unused spares: EOF asks them to exit, SIGKILL makes sure."""
        for proc in self._spares.values():
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._spares.clear()
