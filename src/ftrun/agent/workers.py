"""Spawning one cycle's local workers, relaying their output, and noticing their exits.

Each worker leads its own process group (so a stop reaches its whole tree) and dies with the
agent (PR_SET_PDEATHSIG). One waiter per cycle (`exits.ExitWaiter`, on the workers' pidfds)
posts `WorkerExited` to the agent's queue the moment a worker ends, spawned or forked alike: no
polling. Output goes to per-cycle log files and, as torchrun's --redirects/--tee/
--local-ranks-filter say, to the console with a rank prefix.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

from ftrun.agent.exits import Ending, ExitWaiter
from ftrun.agent.output import NOT_OPEN, FilteredCopy, append_log, filtered_log
from ftrun.agent.placement.binding import prepare_binding
from ftrun.agent.termination import die_with_parent
from ftrun.config.agent import AgentConfig, Std


@dataclasses.dataclass(frozen=True)
class WorkerExited:
    """A worker process ended; `returncode` < 0 means killed by that signal."""

    local_rank: int
    rank: int
    pid: int
    returncode: int


class WorkerProcess(Ending, Protocol):
    """What the group needs of a started worker: `subprocess.Popen`'s shape."""

    stdout: IO[bytes] | None
    stderr: IO[bytes] | None


@dataclasses.dataclass(frozen=True)
class SpawnPath:
    """How one cycle's workers started: "forked" (from the fork server), "spawned" (fresh
    interpreters) or "mixed"; `why` says why any of them was spawned fresh."""

    path: str
    why: str | None = None


class Spawner(Protocol):
    """Starts one worker with `env`; calls `announce(pid)` before the worker's script runs."""

    def spawn(self, env: Mapping[str, str], announce: Callable[[int], None]) -> WorkerProcess: ...

    def cycle_path(self) -> SpawnPath:
        """How this cycle's workers (those spawned since the round began) started."""
        ...


class PlainSpawner:
    """A fresh process running the entrypoint: no pre-imported modules."""

    def __init__(self, entrypoint: tuple[str, ...], why: str | None = None) -> None:
        self._entrypoint = entrypoint
        self._why = why

    def spawn(self, env: Mapping[str, str], announce: Callable[[int], None]) -> WorkerProcess:
        proc = spawn_process(self._entrypoint, env, subprocess.DEVNULL)
        announce(proc.pid)  # the child is still starting its interpreter
        return proc

    def cycle_path(self) -> SpawnPath:
        return SpawnPath("spawned", self._why)


def spawn_process(
    argv: Sequence[str], env: Mapping[str, str], stdin: int
) -> subprocess.Popen[bytes]:
    """Start a process as a worker: own process group, dies with the agent, output piped, bound
    to its CPUs and memory nodes when its env says so (--numa-binding)."""
    # Parsed and looked up here: the child only makes system calls (see placement.binding).
    bind = prepare_binding(env)
    preexec = die_with_parent if bind is None else functools.partial(_bound_child, bind)
    # preexec_fn: only prctl() and the binding's calls through preloaded libc: no lock after fork.
    return subprocess.Popen(list(argv), env=dict(env), stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=preexec)  # noqa: PLW1509  # fmt: skip


def _bound_child(bind: Callable[[], None]) -> None:
    """`preexec_fn` of a bound worker: die with the agent, then take the binding."""
    die_with_parent()
    bind()


@dataclasses.dataclass
class Worker:
    local_rank: int
    rank: int
    proc: WorkerProcess
    log_dir: Path
    stderr_relay: threading.Thread | None = None


class WorkerGroup:
    """The local workers of one cycle."""

    def __init__(self, config: AgentConfig, events: queue.SimpleQueue[object]) -> None:
        self._config = config
        self._events = events
        self.workers: list[Worker] = []
        self._threads: list[threading.Thread] = []
        self._exits = ExitWaiter("worker-exits")

    def start(
        self,
        first_rank: int,
        envs: list[Mapping[str, str]],
        log_dir: Path,
        spawner: Spawner,
        expect: Callable[[int, int], None],
    ) -> None:
        """Spawn one worker per env (local rank = index); ranks start at `first_rank`.

        `expect(rank, pid)` tells the monitor about each worker before it can register.
        """
        try:
            for local_rank, env in enumerate(envs):
                rank = first_rank + local_rank
                worker_dir = log_dir / f"rank{rank}"
                worker_dir.mkdir(parents=True, exist_ok=True)
                proc = spawner.spawn(env, functools.partial(expect, rank))
                worker = Worker(local_rank, rank, proc, worker_dir)
                self.workers.append(worker)
                self._relay(worker)
                self._exits.watch(proc, functools.partial(self._exited, worker))
        finally:
            self._exits.seal()  # no more workers: the waiter ends once their ends are told

    def replace(
        self, local_rank: int, env: Mapping[str, str], spawner: Spawner,
        expect: Callable[[int, int], None],
    ) -> int:  # fmt: skip
        """Start local rank `local_rank`'s worker again (its process is gone, the others run);
        its output goes on into the same log files. The new pid; OSError if it cannot start."""
        old = self.workers[local_rank]
        proc = spawner.spawn(env, functools.partial(expect, old.rank))
        worker = Worker(local_rank, old.rank, proc, old.log_dir)
        self.workers[local_rank] = worker
        self._relay(worker)
        if not self._exits.watch(proc, functools.partial(self._exited, worker), late=True):
            raise OSError("the cycle's exit waiter has ended: no worker is left to join")
        return proc.pid

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def join_threads(self, timeout: float = 5.0) -> None:
        """Wait for the exit waiter and the relay threads of exited workers (bounded)."""
        self._exits.close(timeout)
        for thread in self._threads:
            thread.join(timeout)

    def _exited(self, worker: Worker, code: int) -> None:
        """In the exit waiter's thread: tell the agent."""
        self._events.put(WorkerExited(worker.local_rank, worker.rank, worker.proc.pid, code))

    def _relay(self, worker: Worker) -> None:
        cfg = self._config
        for stream, flag, name, console, filters in (
            (worker.proc.stdout, Std.OUT, "stdout", sys.stdout, cfg.duplicate_stdout_filters),
            (worker.proc.stderr, Std.ERR, "stderr", sys.stderr, cfg.duplicate_stderr_filters),
        ):
            assert stream is not None
            show = self._shows(worker.local_rank, flag)
            prefix = f"[{cfg.role}{worker.rank}]:".encode()
            log = worker.log_dir / f"{name}.log"
            # --duplicate-*-filters: matching console lines, one file per stream and cycle
            filtered = filtered_log(worker.log_dir.parent, name) if show and filters else None
            args = (stream, log, console, show, prefix, filters, filtered)
            thread = threading.Thread(target=_pump, args=args, daemon=True,
                                      name=f"relay-{name}-rank{worker.rank}")  # fmt: skip
            thread.start()
            self._threads.append(thread)
            if name == "stderr":
                worker.stderr_relay = thread

    def _shows(self, local_rank: int, flag: int) -> bool:
        """Whether this stream reaches the console (it always reaches the log file)."""
        ranks_filter = self._config.local_ranks_filter
        if ranks_filter is not None and local_rank not in ranks_filter:
            return False
        redirected = self._config.redirects.get(local_rank, Std.NONE) & flag
        teed = self._config.tee.get(local_rank, Std.NONE) & flag
        return bool(teed or not redirected)

    def stderr_tail(self, pid: int, size: int, timeout: float = 0.5) -> str:
        """The end of an exited worker's stderr log, once its relay has copied what the worker
        wrote (bounded: a child of the worker may hold the pipe open)."""
        worker = next((w for w in self.workers if w.proc.pid == pid), None)
        if worker is None:
            return ""
        if worker.stderr_relay is not None:
            worker.stderr_relay.join(timeout)
        try:
            with (worker.log_dir / "stderr.log").open("rb") as f:
                f.seek(max(0, f.seek(0, 2) - size))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


def _pump(
    stream: IO[bytes],
    path: Path,
    console: IO[str],
    show: bool,
    prefix: bytes,
    filters: Sequence[str] = (),
    filtered: Path | None = None,
) -> None:
    """Copy one worker stream to its log file, the console (when `show`) and, for the lines
    matching `filters`, the shared `filtered` file (`ftrun.agent.output`). A log file that
    cannot be written (a full disk) is given up with one warning; the stream is still read to
    its end (a worker must never block on a full pipe) and the console still gets it."""
    out = console.buffer if show else None
    log_fd = append_log(NOT_OPEN, path, b"")
    with stream, FilteredCopy(filtered, filters, prefix) as copy:
        for line in iter(stream.readline, b""):
            log_fd = append_log(log_fd, path, line)
            copy.feed(line)
            if out is not None:
                try:
                    out.write(prefix + line)
                    out.flush()
                except (OSError, ValueError):
                    out = None  # the console went away; keep the file
    if log_fd >= 0:
        os.close(log_fd)
