"""Learning that processes ended: one waiter for a cycle's workers, and the bounded wait for a
set of processes to be gone (the termination routine's).

Both wait on pidfds (`os.pidfd_open`, Linux 5.3+): a pidfd becomes readable when its process
exits (a zombie counts), whether or not the process is our child, and waiting on it reaps
nothing. So one thread, polling the pidfds of every worker of the cycle (and a pipe that wakes
it for a new worker or to end), learns of each end the moment it happens, for plain workers
(our children) and forked ones (the fork server's children) alike.

The exit status is another matter, and stays with the worker's handle, which is asked once
the pidfd fired (`wait(ASK_S)`: bounded, it returns as soon as the status is there): a plain
worker's `Popen` reaps its child; a forked worker's handle (`prewarm.forked.ForkedWorker`) has
the fork server's "exit" note, which follows the server's reaping by milliseconds, or reads
the zombie's status from /proc while the server reaps nobody (it imports). A handle with no
status by then is asked again (`poll()`) every `ASK_S`. So is a handle without a pidfd: the
kernel has none, the process was reaped before its pidfd was opened, or the pid names no
process (the tests' fake workers).

A pidfd fires only once the whole thread group is gone, though: a CUDA worker's driver threads
can outlive its main thread by 150 ms, while a forked worker's handle reads the main thread's exit
from /proc. So the handles of running processes are asked too, every `LEADER_S`.

Every wait is bounded: the waiter's poll wakes at least every `IDLE_S`, `close` joins it with a
timeout, and `wait_exited` has a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Protocol

import psutil

log = logging.getLogger("ftrun.agent")

ASK_S = 0.02
"""How often a handle whose process ended (or that has no pidfd) is asked for its status."""
IDLE_S = 1.0
"""The longest the waiter waits without looking whether it was closed (a close wakes it)."""
LEADER_S = 0.05
"""How often a running process's handle is asked too: a pidfd fires once the whole thread group
is gone, but a CUDA worker's other threads can take 150 ms more to die after its main thread
exited (measured on an H200), and a forked worker's handle reads the main thread's exit from
/proc (`prewarm.forked`) as it happens."""


class Ending(Protocol):
    """What the waiter needs of a worker's handle: `subprocess.Popen`'s `pid`, `poll()` and
    `wait(timeout)`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclasses.dataclass(frozen=True)
class _Watched:
    proc: Ending
    on_exit: Callable[[int], None]


class ExitWaiter:
    """One thread that calls `on_exit(code)` (in that thread) once each watched process ended.

    It ends by itself once `seal()` said no more processes come and every end was told;
    `close` ends it at the latest after its timeout (ends not told by then never are).
    """

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the thread
        self._waiting: dict[int, _Watched] = {}  # pidfd -> a process still running
        self._asking: list[_Watched] = []  # ended, or no pidfd: asked for the status
        self._sealed = self._closed = self._ended = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, proc: Ending, on_exit: Callable[[int], None], late: bool = False) -> bool:
        """Tell `on_exit` when `proc` ends. `late`: a process added after `seal()` (a rank's
        replacement) while others are still watched; False if the thread has ended already."""
        fd = open_pidfd(proc.pid)
        watched = _Watched(proc, on_exit)
        with self._lock:
            assert late or not self._sealed, "watch after seal"
            if self._ended or self._closed:
                if fd is not None:
                    os.close(fd)
                return False
            if fd is None:
                self._asking.append(watched)
            else:
                self._waiting[fd] = watched
        self._wake()
        return True

    def seal(self) -> None:
        """No more processes come: the thread ends once every end was told."""
        with self._lock:
            self._sealed = True
        self._wake()

    def close(self, timeout: float) -> bool:
        """Wait (at most `timeout`) for every end to be told, then stop; whether it ended."""
        self.seal()
        self._thread.join(timeout)
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(IDLE_S)
        return not self._thread.is_alive()

    def _wake(self) -> None:
        with self._lock, contextlib.suppress(BlockingIOError):
            if not self._ended:  # its pipe is closed then
                os.write(self._wake_w, b"w")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        polled: set[int] = set()
        try:
            while (timeout := self._next_timeout(poller, polled)) is not None:
                for fd, _ in poller.poll(timeout * 1000):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                        continue
                    self._tell(self._release(fd, poller, polled))
                self._ask_running(poller, polled)
                self._ask()
        except Exception:  # a bug here would hide every exit from the agent: say so loudly
            log.exception("the worker exit waiter failed")
        finally:
            self._finish()

    def _next_timeout(self, poller: select.poll, polled: set[int]) -> float | None:
        """Register new pidfds; how long to wait next (None: the thread is done)."""
        with self._lock:
            done = self._sealed and not self._waiting and not self._asking
            if self._closed or done:
                return None
            for fd in self._waiting.keys() - polled:
                poller.register(fd, select.POLLIN)
                polled.add(fd)
            return ASK_S if self._asking else LEADER_S if self._waiting else IDLE_S

    def _tell(self, watched: _Watched) -> None:
        """Its process ended: the status is there, or on its way (a forked worker's note)."""
        try:
            code = watched.proc.wait(ASK_S)
        except subprocess.TimeoutExpired:
            with self._lock:
                self._asking.append(watched)
            return
        watched.on_exit(code)

    def _ask_running(self, poller: select.poll, polled: set[int]) -> None:
        """Still waited on its pidfd: whose handle already has a status (`LEADER_S`)."""
        with self._lock:
            running = [(fd, w) for fd, w in self._waiting.items() if fd in polled]
        for fd, watched in running:
            code = watched.proc.poll()
            if code is not None:
                self._release(fd, poller, polled)
                watched.on_exit(code)

    def _release(self, fd: int, poller: select.poll, polled: set[int]) -> _Watched:
        """Stop waiting on `fd`, an ended process's pidfd (closed): its watch, to be told."""
        poller.unregister(fd)
        polled.discard(fd)
        with self._lock:
            watched = self._waiting.pop(fd)
        os.close(fd)
        return watched

    def _ask(self) -> None:
        with self._lock:
            asking = list(self._asking)
        for watched in asking:
            code = watched.proc.poll()
            if code is not None:
                with self._lock:
                    self._asking.remove(watched)
                watched.on_exit(code)

    def _finish(self) -> None:
        with self._lock:
            self._ended = True
            fds = [*self._waiting, self._wake_r, self._wake_w]
            self._waiting.clear()
        for fd in fds:
            os.close(fd)


def open_pidfd(pid: int) -> int | None:
    """A pidfd for `pid`; None where there is none to have: the process is gone (reaped), the
    pid names no process, or the kernel has no pidfds."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def wait_exited(pids: list[int], timeout: float) -> bool:
    """Block until every pid has exited (a zombie counts) or `timeout` passed; whether they
    all did. On pidfds where the kernel has them, else by looking every `ASK_S`."""
    deadline = time.monotonic() + timeout
    fds = _pidfds(pids)
    if fds is None:
        while (alive := any(_running_pid(pid) for pid in pids)) and time.monotonic() < deadline:
            time.sleep(ASK_S)
        return not alive
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        pending = len(fds)
        while pending and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                pending -= 1
        return pending == 0
    finally:
        for fd in fds:
            os.close(fd)


def _pidfds(pids: list[int]) -> list[int] | None:
    """A pidfd per pid still there; None where the kernel has no pidfds (look instead)."""
    fds: list[int] = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue  # gone already (reaped)
        except (AttributeError, OSError):
            for fd in fds:
                os.close(fd)
            return None
    return fds


def running(proc: psutil.Process) -> bool:
    """Whether the process still runs (a zombie has ended)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _running_pid(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return running(psutil.Process(pid))
    return False
