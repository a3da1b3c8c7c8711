"""The agent's side of the fork server (`forkserver.py`): start it, fork workers, learn their ends.

`ForkServer.start` spawns the server (own process group, SIGKILL when the agent dies) with one end
of a socketpair, or, with `fork`, forks it from the agent itself where that is safe (the server
then inherits the agent's torch import: `launch.py`), and returns at once while it imports.
`spawn` sends the worker's command, environment and cwd together with the write ends of two
fresh pipes, and gets back the pid; the returned `ForkedWorker` is a `subprocess.Popen`
look-alike (`pid`, `stdout`, `stderr`, `wait`, `poll`, `returncode`). The worker is the
server's child, not ours, so one reader thread turns the server's "exit" notes into return
codes. If the server dies, its workers die with it (PDEATHSIG): every handle still running
resolves once its process is gone (to its real status where the agent, a child subreaper, can
reap it; else -SIGKILL), and `spawn` raises `ForkServerError`, upon which the caller spawns
plainly. `deepen` asks the server to import more modules between cycles; a spawn sent meanwhile
waits for that import (no longer than a plain worker's own import of them).

Never signal `ForkServer.pid` when stopping workers: it is no worker, and killing it kills them all.
Call `start` from a thread that lives as long as the server should: PR_SET_PDEATHSIG fires when
the *thread* that spawned the server ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from ftrun.agent.prewarm import wire as proto
from ftrun.agent.prewarm.forked import ForkedWorker, await_death
from ftrun.agent.prewarm.launch import ServerProcess, fork_blocker, fork_server, spawn_server
from ftrun.agent.prewarm.spawn_request import SpawnRequest
from ftrun.agent.prewarm.start_env import path0, start_env_mismatch
from ftrun.agent.prewarm.target import PythonTarget
from ftrun.agent.termination import kill_group_now
from ftrun.errors import FtrunError

log = logging.getLogger("ftrun.agent")

READY_TIMEOUT = 120.0
"""How long after `start` (or `deepen`) a `spawn` may wait for the imports to finish."""
REPLY_TIMEOUT = 30.0
"""A fork takes milliseconds; a server that does not answer for this long is broken."""
CLOSE_TIMEOUT = 5.0
"""`close`: how long the server gets to kill and reap its workers after EOF, before SIGKILL."""
GONE_TIMEOUT = 5.0
"""After the server died: how long its workers get to die of PDEATHSIG."""


class ForkServerError(FtrunError):
    """The fork server cannot start this worker (dead, broken, unsafe to fork, refused, or the
    worker's start-up environment differs): spawn the worker plainly instead."""


class ForkServer:
    """The agent's handle on the node's fork server."""

    def __init__(
        self,
        proc: ServerProcess,
        sock: socket.socket,
        env: Mapping[str, str],
        modules: Sequence[str],
        ready_timeout: float,
    ) -> None:
        self._proc = proc
        self.forked = not isinstance(proc, subprocess.Popen)
        """Forked from the agent (it inherited the agent's imports), not spawned."""
        self._sock = sock
        self._env = dict(env)
        self.modules = tuple(modules)
        """Every module asked for: at start, then by `deepen`."""
        self.modules_at_start = self.modules
        self.imported: tuple[str, ...] = ()
        """The prewarm modules that imported; `failed` did not (the scripts will say why)."""
        self.failed: tuple[str, ...] = ()
        self._ready_by = time.monotonic() + ready_timeout
        self._ready_timeout = ready_timeout
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests: dict[int, SpawnRequest] = {}
        self._workers: dict[int, ForkedWorker] = {}
        self._ready = False
        self.error: str | None = None
        """Why the server cannot fork (any more); None while it can or is still importing."""
        self._closed = False
        self._settled = threading.Event()  # ready, or gone
        self._deepened = threading.Event()  # no "deepen" in flight
        self._deepened.set()
        self._deepen_by = 0.0
        self.deepen_broke = False
        """A "deepen" left the server unforkable (its imports started a thread, say)."""
        self._gone = threading.Event()  # the reader ended: server reaped, handles resolved
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)

    @classmethod
    def start(
        cls,
        modules: Sequence[str],
        env: Mapping[str, str],
        *,
        target: PythonTarget | None = None,
        ready_timeout: float = READY_TIMEOUT,
        fork: bool = False,
    ) -> ForkServer:
        """Start the server, which imports `modules` with `env` as its environment (native
        thread pools limited: `SERVER_ONLY_ENV`); returns at once.

        `target` (optional): the workers' script or module, so that the imports see the
        `sys.path[0]` the workers will have. `fork`: fork the server from this process, which
        imported what it needs with `env` (`launch.environment`) and started no thread yet, so
        that the server inherits those imports; where a fork would not be the server that `env`
        starts (`launch.fork_blocker`, logged) it is spawned. Raises ForkServerError if it
        cannot be started.
        """
        where = path0(target) if target is not None else None
        why = fork_blocker(modules, env, where) if fork else None
        try:
            if fork and why is None:
                proc: ServerProcess
                proc, ours = fork_server(modules, env, where)
            else:
                proc, ours = spawn_server(modules, env, where)
        except OSError as exc:
            raise ForkServerError(f"cannot start the fork server: {exc}") from exc
        if fork:
            how = "forked from the agent" if why is None else f"spawned, not forked: {why}"
            log.info("fork server (pid %d) %s", proc.pid, how)
        server = cls(proc, ours, env, modules, ready_timeout)
        server._reader.start()
        return server

    @property
    def pid(self) -> int:
        """The server's pid: never signal it when stopping workers."""
        return self._proc.pid

    def ready(self, timeout: float) -> bool:
        """Whether the imports are done and the server is alive and able to fork."""
        self._settled.wait(timeout)
        return self._ready and self.error is None and not self._gone.is_set()

    def spawn(
        self,
        target: PythonTarget,
        env: Mapping[str, str],
        cwd: str,
        *,
        announce: Callable[[int], None] | None = None,
    ) -> ForkedWorker:
        """Fork one worker running `python -u [-m] target args` with `env` in `cwd`.

        Waits for the imports (until `ready_timeout` after `start`). With `announce`, the child
        waits until `announce(pid)` returned before it runs the target (a pre-imported worker
        may register with the monitor within milliseconds); if `announce` raises, the child is
        killed and the exception propagates. Raises ForkServerError when the caller should spawn
        the worker plainly.
        """
        req = self._fork(target, env, cwd, gated=announce is not None, cuda_device=None)
        try:
            worker = req.worker
            assert worker is not None
            if announce is not None:
                try:
                    announce(worker.pid)
                except BaseException:
                    kill_group_now(worker.pid)
                    req.discard()
                    raise
                with contextlib.suppress(OSError):  # a child that died meanwhile says so itself
                    os.write(req.gate_fd, b"g")  # type: ignore[arg-type]
            return worker
        finally:
            if req.gate_fd is not None:
                proto.close_fds(req.gate_fd)

    def prestart(
        self, target: PythonTarget, env: Mapping[str, str], cwd: str, cuda_device: int
    ) -> tuple[ForkedWorker, int]:
        """Fork a worker that settles in `env` and `cwd`, makes its CUDA context on
        `cuda_device` (none without CUDA) and then waits on its start gate: the worker and the
        gate's write end, on which `prestart.HeldWorker.release` sends the "go". Raises
        ForkServerError as `spawn` does."""
        req = self._fork(target, env, cwd, gated=True, cuda_device=cuda_device)
        assert req.worker is not None and req.gate_fd is not None
        return req.worker, req.gate_fd

    def _fork(
        self, target: PythonTarget, env: Mapping[str, str], cwd: str, gated: bool,
        cuda_device: int | None,
    ) -> SpawnRequest:  # fmt: skip
        """Send one spawn and wait for the server's answer: the request, its worker made."""
        self._await_forkable(env)
        args = [sys.executable, "-u", *(["-m"] if target.module else []), target.target]
        args += target.args
        req = self._send_spawn(target, env, cwd, args, gated, cuda_device)
        if not req.done.wait(REPLY_TIMEOUT):
            self._break(f"the fork server did not answer a spawn in {REPLY_TIMEOUT:g}s")
            req.done.wait(GONE_TIMEOUT + 1.0)
        if req.worker is None or self._gone.is_set():
            req.discard()
            if req.gate_fd is not None:
                proto.close_fds(req.gate_fd)
            raise ForkServerError(req.error or self.error or "the fork server is gone")
        return req

    def deepen(self, modules: Sequence[str]) -> bool:
        """Ask the server to import `modules` now; returns at once (False: nothing was sent,
        as the server is not ready or cannot fork). Spawns wait for the import to end."""
        modules = [m for m in modules if m not in self.modules]
        if not modules or not self.ready(0) or not self._deepened.is_set():
            return False
        self._deepened.clear()
        self._deepen_by = time.monotonic() + self._ready_timeout
        try:
            with self._send_lock:
                proto.send_frame(self._sock, proto.encode("deepen", modules=list(modules)))
        except OSError as exc:
            self._deepened.set()
            log.warning("fork server: cannot ask for deeper imports: %s", exc)
            return False
        self.modules += tuple(modules)
        return True

    def close(self) -> None:
        """Stop the server and whatever it still runs (EOF, then SIGKILL; bounded); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.error = self.error or "the fork server was closed"
        if self._ready and not self._gone.is_set():
            # EOF: the server kills its workers' groups, reports their ends and exits.
            if self._send_lock.acquire(timeout=CLOSE_TIMEOUT):
                try:
                    with contextlib.suppress(OSError):
                        self._sock.shutdown(socket.SHUT_WR)
                finally:
                    self._send_lock.release()
            self._gone.wait(CLOSE_TIMEOUT)
        if not self._gone.is_set():
            self._kill_server()
        if not self._gone.wait(GONE_TIMEOUT + CLOSE_TIMEOUT):
            log.error("the fork server (pid %d) survived SIGKILL", self._proc.pid)
            return  # its reader still blocks on the socket: leave it open
        self._reader.join(CLOSE_TIMEOUT)
        self._sock.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sending -----------------------------------------------------------------------------

    def _await_forkable(self, env: Mapping[str, str]) -> None:
        """Wait for the imports (bounded); raise ForkServerError if a worker with `env` cannot
        be forked (now)."""
        mismatch = start_env_mismatch(self._env, env)
        if mismatch:
            raise ForkServerError(
                f"the worker's environment differs from the fork server's in {mismatch}, read "
                "at interpreter start: a forked worker would not see its own values"
            )
        if not self._settled.wait(max(0.0, self._ready_by - time.monotonic())):
            raise ForkServerError(
                f"the fork server is still importing {list(self.modules)} "
                f"{self._ready_timeout:g}s after its start"
            )
        if not self._deepened.wait(max(0.0, self._deepen_by - time.monotonic())):
            raise ForkServerError(
                f"the fork server is still importing its deep modules {self._ready_timeout:g}s "
                "after it was asked to"
            )
        if self.error is not None:
            raise ForkServerError(self.error)

    def _send_spawn(
        self, target: PythonTarget, env: Mapping[str, str], cwd: str, args: list[str],
        gated: bool, cuda_device: int | None,
    ) -> SpawnRequest:  # fmt: skip
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        gate_r, gate_w = _gate_pipe() if gated else (None, None)
        req = SpawnRequest(out_r, err_r, gate_w, args)
        fds = [out_w, err_w] + ([gate_r] if gate_r is not None else [])
        rid = None
        try:
            with self._send_lock:
                with self._lock:
                    if self.error is not None:
                        raise ForkServerError(self.error)
                    rid = next(self._ids)
                    self._requests[rid] = req
                frame = proto.encode(
                    "spawn", id=rid, module=target.module, target=target.target,
                    args=list(target.args), env=dict(env), cwd=str(cwd), gate=gated,
                    cuda_device=cuda_device,
                )  # fmt: skip
                proto.send_frame(self._sock, frame, fds)
        except BaseException as exc:
            with self._lock:
                self._requests.pop(rid, None)  # type: ignore[arg-type]
            req.discard()
            if gate_w is not None:
                proto.close_fds(gate_w)
            if isinstance(exc, (OSError, proto.ProtocolViolation)):
                raise ForkServerError(f"cannot send to the fork server: {exc}") from exc
            raise
        finally:
            proto.close_fds(*fds)  # the server has its copies now (or never will)
        return req

    # ---- the reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        reason = "the fork server exited"
        try:
            while True:
                frame = proto.recv_frame(self._sock)
                if frame is None:
                    break
                self._handle(proto.decode(frame[0], proto.TO_AGENT))
        except proto.ProtocolViolation as exc:
            reason = f"the fork server broke the protocol: {exc}"
        except OSError as exc:
            reason = f"the fork server's connection failed: {exc}"
        except Exception as exc:  # a bug here must still resolve every handle
            log.exception("fork server reader failed")
            reason = f"the fork server's reader failed: {exc!r}"
        finally:
            self._server_gone(reason)

    def _handle(self, msg: dict[str, object]) -> None:
        op = msg["op"]
        if op == "hello":
            if msg["pid"] != self._proc.pid:
                raise proto.ProtocolViolation(f"hello from pid {msg['pid']}, not {self.pid}")
        elif op in ("ready", "deepened"):  # the imports at start, or `deepen`'s, are done
            deep = op == "deepened"
            self.imported += tuple(msg["imported"])  # type: ignore[arg-type]
            self.failed += tuple(msg["failed"])  # type: ignore[arg-type]
            if msg["unforkable"] is not None:
                self.deepen_broke = deep
                with self._lock:
                    self.error = self.error or f"cannot fork workers: {msg['unforkable']}"
                log.warning("fork server: after its deep imports, %s" if deep
                            else "fork server: %s; workers start plainly", self.error)  # fmt: skip
            self._ready = True
            (self._deepened if deep else self._settled).set()
        elif op == "spawned":
            with self._lock:
                req = self._requests.pop(msg["id"], None)  # type: ignore[arg-type]
            if req is None:  # a worker we hold no pipes for, and cannot account for
                raise proto.ProtocolViolation(f"spawned for unknown request {msg['id']}")
            pid = msg["pid"]
            assert isinstance(pid, int)
            worker = ForkedWorker(pid, req.stdout_fd, req.stderr_fd, req.args)
            with self._lock:
                self._workers[pid] = worker
            req.worker = worker
            req.done.set()
        elif op == "error":
            with self._lock:
                req = self._requests.pop(msg["id"], None)  # type: ignore[arg-type]
            if req is None:  # about no request of ours: something else wrote to the server
                log.warning("fork server: %s", msg["error"])
                return
            req.error = f"the fork server refused: {msg['error']}"
            req.done.set()
        elif op == "exit":
            with self._lock:
                worker = self._workers.pop(msg["pid"], None)  # type: ignore[arg-type]
            if worker is not None:
                worker._resolve(msg["code"])  # type: ignore[arg-type]

    def _server_gone(self, reason: str) -> None:
        with self._lock:
            self.error = self.error or reason
            requests = list(self._requests.values())
            self._requests.clear()
            workers = list(self._workers.values())
            self._workers.clear()
        self._settled.set()
        self._deepened.set()
        for req in requests:
            req.done.set()  # no worker: spawn() raises
        self._kill_server()
        if not self._closed or workers:
            proc = self._proc
            log.warning("fork server (pid %d) gone, exit code %s: %s; %d worker(s) died with it",
                        proc.pid, proc.returncode, self.error, len(workers))  # fmt: skip
        deadline = time.monotonic() + GONE_TIMEOUT
        for worker in workers:
            worker._resolve(await_death(worker.pid, deadline))
        self._gone.set()

    def _break(self, reason: str) -> None:
        with self._lock:
            self.error = self.error or reason
        log.error("fork server: %s; killing it", reason)
        self._kill_server()

    def _kill_server(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(CLOSE_TIMEOUT)


def _gate_pipe() -> tuple[int, int]:
    """A start gate: big enough for a prestarted worker's "go" (its environment) to be written
    at once while the child still makes its CUDA context."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 20)
    return read_end, write_end
