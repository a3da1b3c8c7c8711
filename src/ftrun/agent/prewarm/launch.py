"""How the agent starts its fork server: spawned, or forked from the agent itself.

Spawned (`spawn_server`): `python -u -m ftrun.agent.prewarm.forkserver`, which imports the
prewarm modules itself. Forked (`fork_server`): the agent forks right after its own import of
torch (which it needs for the store), before it starts any thread, and the server inherits that
import instead of paying for it a second time (about 1.5 s of CPU per node, taken from the
agent's own start-up). The child forgets the agent (`inherit.serve`) and runs the server's loop;
it never returns into the agent's code. Either way the server is the agent's child, in its own
session, SIGKILLed when the agent dies, and reaped by the agent (a forked one by `ForkedServer`).

A fork of the agent stands in for a spawned server only where nothing tells them apart
(`fork_blocker`): one thread only (Python's and the OS's count: a native library's thread pool
counts), CUDA untouched, the interpreter started without options (`-u` aside), the variables
read at process start equal to the server's (`start_env.agent_start_mismatch`), torch among the
prewarm modules wherever the agent imported it (else the workers would get a torch they never
asked for), and no module the agent imported shadowed by the workers' `sys.path[0]`. The agent
imports torch with the server's environment as os.environ (`environment`), so what torch reads
at import is what a spawned server's import would have read. Any later server (a replacement,
`PrewarmService._replace`) is spawned: by then the agent runs threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from ftrun.agent.exits import wait_exited
from ftrun.agent.prewarm.pools import SERVER_ONLY_ENV
from ftrun.agent.prewarm.start_env import agent_start_mismatch, process_start_env
from ftrun.agent.termination import die_with_parent

AGENT_IMPORTS = ("torch",)
"""The top-level packages the agent imports for itself before it starts its server."""
_CPP_LOG_LEVELS = {"0": 0, "INFO": 0, "1": 1, "WARNING": 1, "2": 2, "ERROR": 2, "3": 3,
                   "FATAL": 3}  # fmt: skip
"""TORCH_CPP_LOG_LEVEL's values, as c10 reads them at torch's import."""


class ServerProcess(Protocol):
    """The server's process as `ForkServer` holds it: a `subprocess.Popen`, or `ForkedServer`."""

    pid: int
    returncode: int | None

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def spawn_server(
    modules: Sequence[str], env: Mapping[str, str], path0: str | None
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Spawn `python -u -m ftrun.agent.prewarm.forkserver`; its process and our socket end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [sys.executable, "-u", "-m", "ftrun.agent.prewarm.forkserver"]
    argv += ["--fd", str(theirs.fileno()), "--parent", str(os.getpid())]
    if path0 is not None:
        argv += ["--path0", path0]
    argv += ["--", *modules]
    try:
        # stdout: its own errors go to the agent's stderr; preexec_fn: only a prctl() through a
        # preloaded libc, nothing that takes a lock after fork.
        proc = subprocess.Popen(argv, env={**env, **SERVER_ONLY_ENV}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                                start_new_session=True,
                                preexec_fn=die_with_parent)  # noqa: PLW1509  # fmt: skip
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


def fork_server(
    modules: Sequence[str], env: Mapping[str, str], path0: str | None
) -> tuple[ForkedServer, socket.socket]:
    """Fork the server from this process (only where `fork_blocker` says nothing); the child
    serves as `python -u -m ...forkserver --path0 path0 modules` with `env` would, and never
    returns. Raises OSError if the fork fails."""
    from ftrun.agent.prewarm import inherit  # the child's part: nothing the agent needs

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # else the child would write our buffer again
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        raise
    if pid == 0:
        try:
            ours.close()
            inherit.serve(theirs.detach(), parent, path0 or os.getcwd(), modules, env)
        finally:
            os._exit(inherit.CHILD_BROKEN)  # never back into the agent, whatever happened
    theirs.close()
    return ForkedServer(pid), ours


def fork_blocker(
    modules: Sequence[str], env: Mapping[str, str], path0: str | None, planned: Sequence[str] = ()
) -> str | None:
    """Why a fork of this process now would not be the server that `env` starts (None: it
    would be); `planned`: top-level packages this process will import before it forks."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        return f"the agent runs {threads} threads"
    options = _interpreter_options()
    if options:
        return f"the agent's interpreter was started with {options}, the server's would not be"
    mismatch = agent_start_mismatch(process_start_env(), env)
    if mismatch:
        return f"the agent's process was started with other {mismatch} than the workers get"
    asked = {module.split(".")[0] for module in modules}
    unasked = [p for p in AGENT_IMPORTS if (p in planned or p in sys.modules) and p not in asked]
    if unasked:
        return f"the prewarm modules leave out {unasked}, which the agent imports"
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "the agent initialised CUDA"
    shadowed = _shadowed(path0 or os.getcwd())
    if shadowed:
        return f"the workers' sys.path[0] {path0} holds modules the agent imported: {shadowed}"
    return None


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ is `env` inside, this process's own again after: the modules imported inside
    read at import what they would read in a process started with `env`."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def set_cpp_log_level(value: str) -> bool:
    """Give torch's C++ logging the level `value` (as TORCH_CPP_LOG_LEVEL names it) after
    torch's import read another; whether it could (c10's flag is in libc10's symbol table)."""
    level = _CPP_LOG_LEVELS.get(value.strip().upper())
    torch = sys.modules.get("torch")
    if level is None or torch is None:
        return False
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value = level
    except (OSError, ValueError):
        return False
    return True


class ForkedServer:
    """A forked server as `ForkServer` holds it: the `subprocess.Popen` calls it makes. It is
    our child: reaped here (`poll`, `wait`), never signalled once reaped (its pid may be
    another process's by then)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # the reader thread and close() may both wait

    def poll(self) -> int | None:
        with self._lock:
            return self._poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(["fork server", str(self.pid)], timeout or 0.0)
            wait_exited([self.pid], min(left, 1.0))
        return code

    def kill(self) -> None:
        with self._lock:
            if self._poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)

    def _poll(self) -> int | None:
        if self.returncode is None:
            try:
                got, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost (as Popen)
                self.returncode = 0
            else:
                if got == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _interpreter_options() -> list[str]:
    """The options this interpreter was started with, other than -u and the -m or -c that
    names what it runs (a console script's shebang adds none)."""
    options = sys.orig_argv[1 : len(sys.orig_argv) - len(sys.argv)]
    return [option for option in options if option not in ("-u", "-m", "-c")]


def _shadowed(path0: str) -> list[str]:
    """Top-level modules imported here from elsewhere that `path0` holds its own of: first on
    the workers' sys.path, its copy is the one a worker started fresh would import."""
    try:
        entries = sorted(os.listdir(path0))
    except OSError:
        return []
    suffixes = tuple(importlib.machinery.all_suffixes())
    root = os.path.join(os.path.realpath(path0), "")
    found = []
    for entry in entries:
        name = entry.partition(".")[0]
        module = sys.modules.get(name)
        if module is None or name in found or name == "__main__":  # a directory target's own
            continue
        path = os.path.join(path0, entry)
        if not entry.endswith(suffixes) and not any(
            os.path.exists(os.path.join(path, "__init__" + suffix)) for suffix in suffixes
        ):
            continue  # not a module, or a namespace portion (a regular package wins over it)
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if origin in ("built-in", "frozen"):
            continue  # found before sys.path is looked at
        if origin is None or not os.path.realpath(origin).startswith(root):
            found.append(name)
    return found
