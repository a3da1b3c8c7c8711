"""The fork server: one process per node that imports the heavy modules once and forks workers.

Run by the agent (`client.ForkServer.start`) as
`python -u -m ftrun.agent.prewarm.forkserver --fd N [--parent PID] [--path0 DIR] MODULE...`,
with one end of a Unix stream socketpair as fd N, or forked from the agent right after the
agent's own import of torch (`launch.fork_server`; `inherit.py` makes the child what this
command would have started, then calls `main`). It says hello, imports the modules (errors
swallowed: the script reports its own), says ready, then serves until EOF on the socket.

It never starts a thread and never touches CUDA: before each fork it checks that it is the only
thread (Python's and the OS's view) and that CUDA was not initialised, and refuses otherwise (the
agent then spawns plainly). The agent starts it with native thread pools limited
(`pools.SERVER_ONLY_ENV`), and each child sets them back to what its own environment asks
(`pools.restore_thread_pools`). Between cycles the agent may ask it to "deepen": import more
modules (torch._dynamo, inductor) that the first cycle should not wait for.

A forked child becomes the worker exactly as `python -u [-m] target args` would have started:
its own session and process group, SIGKILL when the server dies, stdin from /dev/null,
stdout/stderr on the pipes the agent sent (SCM_RIGHTS), the given environment and cwd,
sys.argv/sys.path[0] as python sets them, the server's signal changes undone, fresh random
seeds; then the target runs (a script in a new `__main__` module, as python does; `-m` through
runpy) and the child ends like the interpreter would (SystemExit codes, traceback and 1, thread
join, atexit, flush, `os._exit`).

What a fork cannot give back: the str hash seed (shared by all workers of a server, unless
PYTHONHASHSEED fixes it anyway), and whatever the prewarm imports read from the environment
(the agent refuses workers whose interpreter/thread variables differ: `start_env.IMPORT_TIME_*`).
After the imports the server runs gc.collect() and gc.freeze(): the children's collector then
leaves the shared objects alone and their pages stay shared (copy-on-write).

The wire protocol is in `wire.py`; what a forked child does to become the worker, in
`child.py`.

This module is imported by the server before anything else: keep it to the standard library.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ftrun.agent.prewarm.child import CHILD_BROKEN, become_worker, is_open, open_fds
from ftrun.agent.prewarm.wire import (
    MAX_FDS,
    TO_SERVER,
    ProtocolViolation,
    close_fds,
    decode,
    encode,
    recv_frame,
    send_frame,
)
from ftrun.agent.termination import KILL_WAIT_S, kill_group_now, wait_reaped

# ---- the server -----------------------------------------------------------------------------


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.children: set[int] = set()
        # What a fresh interpreter has, to be restored in each child: the signal state before
        # this server changed anything, and the fds opened by the prewarm imports (the modules
        # hold them; a worker importing them itself would have them too). Any other fd is closed.
        self.initial_handlers = {signal.SIGCHLD: signal.getsignal(signal.SIGCHLD)}
        self.initial_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.keep_fds: frozenset[int] = frozenset()
        self.wake_r, self.wake_w = os.pipe()
        self.unforkable: str | None = None

    def prewarm(self, modules: list[str]) -> tuple[list[str], list[str]]:
        """Import `modules` (at start, and again for each "deepen"); once a module leaves a
        thread or CUDA behind, the server stays unforkable: an import cannot be undone."""
        before = open_fds()
        imported, failed = [], []
        for module in modules:
            try:
                importlib.import_module(module)
            except BaseException:  # the script will report a broken import itself
                failed.append(module)
            else:
                imported.append(module)
        self.keep_fds |= frozenset(fd for fd in open_fds() - before if is_open(fd))
        # Copy-on-write stays shared only if the children's collector leaves these objects
        # alone: a full collection in a child would otherwise dirty every page that holds one
        # (measured: 74 MiB private per torch worker without this, 4 MiB with it).
        gc.collect()
        gc.freeze()
        # A module may start a helper thread that ends soon after its import; give it a moment.
        deadline = time.monotonic() + 1.0
        while (blocker := fork_blocker()) is not None and time.monotonic() < deadline:
            select.select([], [], [], 0.01)
        self.unforkable = self.unforkable or blocker
        return imported, failed

    def serve(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd fires
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        poller = select.poll()  # not epoll: no fd of its own to leak into children
        poller.register(self.sock, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        try:
            while True:
                for fd, _ in poller.poll():
                    if fd == self.wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(self.wake_r, 512):
                                pass
                    elif not self._handle_frame():
                        return
                self._reap()
        finally:
            self._shutdown()

    def _handle_frame(self) -> bool:
        """Serve one request; False when the agent is gone or broke the framing."""
        try:
            frame = recv_frame(self.sock, MAX_FDS)
        except ProtocolViolation as exc:
            self._send_quietly(encode("error", id=None, error=f"fatal: {exc}"))
            _warn(f"stopping: {exc}")
            return False
        except OSError:
            return False
        if frame is None:
            return False
        payload, fds = frame
        try:
            msg = decode(payload, TO_SERVER)
        except ProtocolViolation as exc:
            close_fds(*fds)
            self.send(encode("error", id=_id_of(payload), error=f"rejected: {exc}"))
            return True
        try:
            if msg["op"] == "deepen":
                close_fds(*fds)  # a deepen carries none; any sent are not ours to keep
                # At normal priority: an unprivileged process cannot leave SCHED_IDLE or undo a
                # nice, and every worker forked later would inherit it.
                imported, failed = self.prewarm(msg["modules"])
                self.send(encode("deepened", imported=imported, failed=failed,
                                 unforkable=self.unforkable))  # fmt: skip
            else:
                self._spawn(msg, fds)
        finally:
            close_fds(*fds)
        return True

    def _spawn(self, msg: dict[str, Any], fds: list[int]) -> None:
        want = 3 if msg["gate"] else 2
        if msg["cuda_device"] is not None and not msg["gate"]:
            problem: str | None = "a prestarted worker (cuda_device) needs a start gate"
        elif len(fds) != want:
            problem = f"expected {want} file descriptors, got {len(fds)}"
        else:
            problem = self.unforkable or fork_blocker()
        if problem is None and not os.path.isdir(msg["cwd"]):
            problem = f"cwd {msg['cwd']!r} is not a directory"
        bad_names = [k for k in msg["env"] if not k or "=" in k or "\0" in k + msg["env"][k]]
        if problem is None and bad_names:
            problem = f"invalid environment variable(s) {bad_names}"
        if problem is None:
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                problem = f"fork failed: {exc}"
        if problem is not None:
            self.send(encode("error", id=msg["id"], error=problem))
            return
        if pid == 0:
            try:
                become_worker(self, msg, fds)
            except BaseException:
                with contextlib.suppress(BaseException):
                    os.write(2, f"ftrun fork server child:\n{traceback.format_exc()}".encode())
            finally:
                os._exit(CHILD_BROKEN)
        self.children.add(pid)
        self.send(encode("spawned", id=msg["id"], pid=pid))

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send(encode("exit", pid=pid, code=os.waitstatus_to_exitcode(status)))

    def _shutdown(self) -> None:
        """Kill what is left (whole groups), reap it and report it, as far as the agent listens."""
        for pid in self.children:
            kill_group_now(pid)
        deadline = time.monotonic() + KILL_WAIT_S
        for pid in list(self.children):
            code = wait_reaped(pid, max(0.0, deadline - time.monotonic()))
            if code is not None:
                self._send_quietly(encode("exit", pid=pid, code=code))
        self.children.clear()

    def send(self, frame: bytes) -> None:
        send_frame(self.sock, frame)

    def _send_quietly(self, frame: bytes) -> None:
        with contextlib.suppress(OSError):
            self.send(frame)


def fork_blocker() -> str | None:
    """Why forking now would be unsafe (other threads, CUDA initialised); None if it is not."""
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return f"the fork server has Python threads {names}, started by a prewarm module"
    tasks = _os_threads()
    if len(tasks) != 1:
        return (
            f"the fork server has {len(tasks)} OS threads {tasks}, started by a prewarm module's "
            "native library (e.g. OpenBLAS without OMP_NUM_THREADS=1)"
        )
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "a prewarm module initialised CUDA in the fork server"
    return None


def _os_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        # The thread may have ended meanwhile.
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f"{tid}:{f.read().strip()}")
    return names


def _id_of(payload: bytes) -> int | None:
    """The request id of a message that failed validation, if it has a usable one."""
    with contextlib.suppress(Exception):
        value = json.loads(payload).get("id")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _warn(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"ftrun fork server: {text}", file=sys.stderr, flush=True)


# ---- entry point ----------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    fd, parent, path0, modules = _parse(argv)
    sock = socket.socket(fileno=fd)
    if parent is not None and os.getppid() != parent:
        return 1  # the agent died before it could arm PDEATHSIG for us
    if path0 is not None:
        sys.path[0] = path0
    server = _Server(sock)
    try:
        server.send(encode("hello", pid=os.getpid()))
        imported, failed = server.prewarm(modules)
        server.send(encode("ready", imported=imported, failed=failed, unforkable=server.unforkable))
    except OSError:
        return 0  # the agent is gone
    if server.unforkable is not None:
        _warn(f"cannot fork workers: {server.unforkable}")
    with contextlib.suppress(OSError):  # the agent is gone
        server.serve()
    return 0


def _parse(argv: list[str]) -> tuple[int, int | None, str | None, list[str]]:
    given: dict[str, str] = {}
    args = list(argv)
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--":
            break
        if not args:
            raise SystemExit(f"usage: {flag} needs a value")
        if flag not in ("--fd", "--parent", "--path0"):
            raise SystemExit(f"usage: unknown option {flag}")
        given[flag] = args.pop(0)
    fd, parent = int(given.get("--fd", -1)), given.get("--parent")
    if fd < 0:
        raise SystemExit("usage: python -m ftrun.agent.prewarm.forkserver --fd N [MODULE...]")
    return fd, None if parent is None else int(parent), given.get("--path0"), args


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
