"""A worker forked by the fork server, as the agent holds it: a `subprocess.Popen` look-alike.

The worker is the server's child, not the agent's. Its end is learned from a pidfd, which
serves a non-child as well (`agent.exits`: the agent's exit waiter, and `wait` here); its
status from the server: the "exit" note (`ForkServer`'s reader thread calls `_resolve`), or,
once the server died, `await_death` (the agent, a child subreaper, may reap it itself). The
note can come late: while the server imports its deep modules it reaps nobody. So `poll` also
reads the exit status of an unreaped worker from /proc (a zombie's `exit_code`, Linux 3.5+): a
crash is seen when it happens, not when the server is done importing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import BinaryIO

from ftrun.agent.exits import wait_exited

STEP_S = 1.0
"""`wait()` without a timeout waits in steps this long (each one bounded)."""
STATE, STARTTIME, EXIT_CODE = 0, 19, 49
"""proc(5) fields 3, 22 and 52 of /proc/PID/stat, counted after the command's closing ')'."""


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class ForkedWorker:
    """A worker forked by the server, with the Popen interface the agent uses."""

    def __init__(self, pid: int, stdout_fd: int, stderr_fd: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.stdout: BinaryIO = open(stdout_fd, "rb")  # noqa: SIM115 - owned like Popen's pipes
        self.stderr: BinaryIO = open(stderr_fd, "rb")  # noqa: SIM115
        self.returncode: int | None = None
        self._done = threading.Event()
        self._resolve_lock = threading.Lock()
        # Which process `pid` is: a reused pid (after the server reaped ours) is not read.
        fields = _stat(pid)
        self._started = fields[STARTTIME] if fields else None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_zombie()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (negative: killed by that signal); TimeoutExpired as Popen raises it.

        The end is waited for on a pidfd; once there, the status is the zombie's, or, if the
        server reaped the worker already, its note's (on its way: it follows the reaping)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            step = STEP_S if deadline is None else deadline - time.monotonic()
            if step <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            if wait_exited([self.pid], step) and self.poll() is None:
                self._done.wait(step if deadline is None else deadline - time.monotonic())
        assert self.returncode is not None
        return self.returncode

    def __repr__(self) -> str:
        return f"<ForkedWorker pid={self.pid} returncode={self.returncode}>"

    def _read_zombie(self) -> None:
        fields = _stat(self.pid)
        if fields and fields[STATE] == "Z" and fields[STARTTIME] == self._started:
            with contextlib.suppress(IndexError, ValueError):
                self._resolve(os.waitstatus_to_exitcode(int(fields[EXIT_CODE])))

    def _resolve(self, code: int) -> None:
        with self._resolve_lock:
            if self.returncode is None:
                self.returncode = code
                self._done.set()


def await_death(pid: int, deadline: float) -> int:
    """A dead server's worker: once it ended (on a pidfd, until `deadline`), its real status
    if we can reap it (the agent is a subreaper: it re-parented to us as the server died);
    else -SIGKILL, which is how PDEATHSIG ends it."""
    wait_exited([pid], max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(ChildProcessError):
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
    return -signal.SIGKILL
