"""A worker forked by the fork server, as the agent holds it: a `subprocess.Popen` look-alike.

The worker is the server's child, not the agent's: its return code arrives as the server's
"exit" note (`ForkServer`'s reader thread calls `_resolve`), or, once the server died, from
`await_death` (the agent, a child subreaper, may reap it itself). The note can come late: while
the server imports its deep modules it reaps nobody. So `poll` and `wait` also read the exit
status of an unreaped worker from /proc (a zombie's `exit_code`, Linux 3.5+): a crash is seen
when it happens, not when the server is done importing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import BinaryIO

ZOMBIE_POLL = 0.05
"""Seconds between looks at /proc while waiting for a worker (the server's note may be late)."""
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
        self.stdin: BinaryIO | None = None
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
        """The exit code (negative: killed by that signal); TimeoutExpired as Popen raises it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = (
                ZOMBIE_POLL if deadline is None else min(deadline - time.monotonic(), ZOMBIE_POLL)
            )
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            self._done.wait(left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            stream.close()
        self.wait()

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
    """A dead server's worker: its real status if we can reap it (we are a subreaper), once
    it is gone; else -SIGKILL, which is how PDEATHSIG ends it."""
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            if not _alive(pid):
                return -signal.SIGKILL
        else:
            if got == pid:
                return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return -signal.SIGKILL
        time.sleep(0.005)


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[STATE] not in {"Z", "X"}
