"""The fork server: one process per node that imports the heavy modules once and forks workers.

Run by the agent (`client.ForkServer.start`) as
`python -u -m ftrun.agent.prewarm.forkserver --fd N [--parent PID] [--path0 DIR] MODULE...`,
with one end of a Unix stream socketpair as fd N. It says hello, imports the modules (errors
swallowed: the script reports its own), says ready, then serves until EOF on the socket.

It never starts a thread and never touches CUDA: before each fork it checks that it is the only
thread (Python's and the OS's view) and that CUDA was not initialised, and refuses otherwise (the
agent then spawns plainly). A forked child becomes the worker exactly as `python -u [-m] target
args` would have started: its own session and process group, SIGKILL when the server dies,
stdin from /dev/null, stdout/stderr on the pipes the agent sent (SCM_RIGHTS), the given
environment and cwd, sys.argv/sys.path[0] as python sets them, the server's signal changes
undone, fresh random seeds; then the target runs (a script in a new `__main__` module, as
python does; `-m` through runpy) and the child ends like the interpreter would (SystemExit codes,
traceback and 1, thread join, atexit, flush, `os._exit`).

What a fork cannot give back: the str hash seed (shared by all workers of a server, unless
PYTHONHASHSEED fixes it anyway), and whatever the prewarm imports read from the environment
(the agent refuses workers whose interpreter/thread variables differ: `client.IMPORT_TIME_*`).
After the imports the server runs gc.collect() and gc.freeze(): the children's collector then
leaves the shared objects alone and their pages stay shared (copy-on-write).

Wire format, both directions: a 4-byte big-endian length, then that many bytes of a JSON object
with "v" (PROTOCOL_VERSION) and "op"; no pickle. Agent -> server: "spawn" (with the child's
stdout/stderr write ends, and optionally a start gate's read end, as SCM_RIGHTS on the same
sendmsg). Server -> agent: "hello", "ready", "spawned", "error", "exit". `decode` validates every
field on both sides. A frame longer than MAX_FRAME breaks the framing: the server then stops;
a well-framed but invalid message gets an "error" reply and the server carries on.

This module is imported by the server before anything else: keep it to the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20
"""Bytes; a spawn request is mostly its environment, far below this."""
MAX_FDS = 3
"""stdout and stderr write ends, and the optional start gate's read end."""
_HEADER = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1
_CHILD_BROKEN = 70
"""Exit code of a child that could not become the worker (EX_SOFTWARE)."""
_libc = ctypes.CDLL(None, use_errno=True)  # loaded now: no dlopen between fork and run


class ProtocolViolation(ValueError):
    """A frame or message that does not follow the protocol."""


# ---- protocol (shared with client.py) -------------------------------------------------------

_STR_LIST = "list[str]"
_STR_MAP = "dict[str,str]"
_OPT_INT = "int|None"
_OPT_STR = "str|None"

TO_SERVER: dict[str, dict[str, object]] = {
    "spawn": {
        "id": int,
        "module": bool,
        "target": str,
        "args": _STR_LIST,
        "env": _STR_MAP,
        "cwd": str,
        "gate": bool,
    },
}
TO_AGENT: dict[str, dict[str, object]] = {
    "hello": {"pid": int},
    "ready": {"imported": _STR_LIST, "failed": _STR_LIST, "unforkable": _OPT_STR},
    "spawned": {"id": int, "pid": int},
    "error": {"id": _OPT_INT, "error": str},
    "exit": {"pid": int, "code": int},
}


def encode(op: str, **fields: Any) -> bytes:
    """One frame: length header and the JSON message."""
    payload = json.dumps({"v": PROTOCOL_VERSION, "op": op, **fields}).encode()
    if len(payload) > MAX_FRAME:
        raise ProtocolViolation(f"{op} message of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes, schema: Mapping[str, Mapping[str, object]]) -> dict[str, Any]:
    """The message in one frame's payload, checked against `schema` (TO_SERVER or TO_AGENT)."""
    try:
        msg = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolViolation(f"not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolViolation(f"not a JSON object: {type(msg).__name__}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolViolation(f"protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    op = msg.get("op")
    fields = schema.get(op) if isinstance(op, str) else None
    if fields is None:
        raise ProtocolViolation(f"unknown op {op!r}")
    extra = set(msg) - set(fields) - {"v", "op"}
    if extra:
        raise ProtocolViolation(f"{op}: unexpected field(s) {sorted(extra)}")
    for name, kind in fields.items():
        if name not in msg:
            raise ProtocolViolation(f"{op}: missing field {name!r}")
        if not _conforms(msg[name], kind):
            raise ProtocolViolation(f"{op}: field {name!r} is not {_kind_name(kind)}")
    return msg


def _conforms(value: object, kind: object) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is bool or kind is str:
        return isinstance(value, kind)  # type: ignore[arg-type]
    if kind == _OPT_INT:
        return value is None or _conforms(value, int)
    if kind == _OPT_STR:
        return value is None or isinstance(value, str)
    if kind == _STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == _STR_MAP:
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    raise AssertionError(kind)


def _kind_name(kind: object) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)


def recv_frame(sock: socket.socket, max_fds: int = 0) -> tuple[bytes, list[int]] | None:
    """The next frame's payload and the fds that came with it; None on EOF before a frame.

    Reads exactly one frame (never into the next one's bytes, to which the kernel attaches that
    frame's fds). Received fds are closed again when the frame is broken.
    """
    fds: list[int] = []
    try:
        header = _recv_exact(sock, _HEADER.size, fds, max_fds, eof_ok=True)
        if header is None:
            return None
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME:
            raise ProtocolViolation(f"frame of {size} bytes exceeds {MAX_FRAME}")
        payload = _recv_exact(sock, size, fds, max_fds, eof_ok=False)
        assert payload is not None
    except BaseException:
        _close_all(fds)
        raise
    return payload, fds


def _recv_exact(
    sock: socket.socket, size: int, fds: list[int], max_fds: int, eof_ok: bool
) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        if max_fds:
            chunk, got, flags, _ = socket.recv_fds(sock, size - len(data), max_fds)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolViolation(f"more than {max_fds} file descriptors in one frame")
        else:
            chunk = sock.recv(size - len(data))
        if not chunk:
            if eof_ok and not data:
                return None
            raise ProtocolViolation(f"EOF inside a frame ({len(data)} of {size} bytes)")
        data += chunk
    return bytes(data)


def send_frame(sock: socket.socket, frame: bytes, fds: Sequence[int] = ()) -> None:
    """Send one frame; `fds` travel with its first byte (SCM_RIGHTS)."""
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else 0
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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
        before = _open_fds()
        imported, failed = [], []
        for module in modules:
            try:
                importlib.import_module(module)
            except BaseException:  # the script will report a broken import itself
                failed.append(module)
            else:
                imported.append(module)
        self.keep_fds = frozenset(fd for fd in _open_fds() - before if _is_open(fd))
        # Copy-on-write stays shared only if the children's collector leaves these objects
        # alone: a full collection in a child would otherwise dirty every page that holds one
        # (measured: 74 MiB private per torch worker without this, 4 MiB with it).
        gc.collect()
        gc.freeze()
        # A module may start a helper thread that ends soon after its import; give it a moment.
        deadline = time.monotonic() + 1.0
        while (blocker := fork_blocker()) is not None and time.monotonic() < deadline:
            select.select([], [], [], 0.01)
        self.unforkable = blocker
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
            _close_all(fds)
            self.send(encode("error", id=_id_of(payload), error=f"rejected: {exc}"))
            return True
        try:
            self._spawn(msg, fds)
        finally:
            _close_all(fds)
        return True

    def _spawn(self, msg: dict[str, Any], fds: list[int]) -> None:
        want = 3 if msg["gate"] else 2
        problem = (
            f"expected {want} file descriptors, got {len(fds)}"
            if len(fds) != want
            else self.unforkable or fork_blocker()
        )
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
                _become_worker(self, msg, fds)
            except BaseException:
                with contextlib.suppress(BaseException):
                    os.write(2, f"ftrun fork server child:\n{traceback.format_exc()}".encode())
            finally:
                os._exit(_CHILD_BROKEN)
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
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # not yet its group's leader
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(pid, 0)
                self._send_quietly(encode("exit", pid=pid, code=os.waitstatus_to_exitcode(status)))
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
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{tid}:{f.read().strip()}")
        except OSError:
            continue  # ended meanwhile
    return names


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _is_open(fd: int) -> bool:
    """Whether `fd` is open still (not the one that listed /proc/self/fd, say)."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


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


# ---- in the forked child --------------------------------------------------------------------


def _become_worker(server: _Server, msg: dict[str, Any], fds: list[int]) -> None:
    """Turn this fresh fork into the worker and run it; never returns."""
    os.setsid()
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server.pid:  # the server died before PDEATHSIG was armed
        os.kill(os.getpid(), signal.SIGKILL)
    # Undo the server's signal set-up before anything can arrive for the worker.
    signal.set_wakeup_fd(-1)
    for signum, handler in server.initial_handlers.items():
        signal.signal(signum, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, server.initial_mask)
    # stdio: /dev/null and the agent's pipes on 0, 1, 2; every other fd of the server closed.
    out, err, *gate = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    keep = {0, 1, 2, *gate, *server.keep_fds}
    for fd in _open_fds() - keep:
        with contextlib.suppress(OSError):
            os.close(fd)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    for stream in (sys.stdout, sys.stderr):  # as `python -u` makes them
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=False, write_through=True)  # type: ignore[union-attr]
    if gate and os.read(gate[0], 1) != b"g":
        os._exit(_CHILD_BROKEN)  # the agent withdrew the start (or died)
    for fd in gate:
        os.close(fd)
    os.environ.clear()
    os.environ.update(msg["env"])
    try:
        os.chdir(msg["cwd"])
    except OSError as exc:
        print(f"ftrun fork server: cannot chdir to {msg['cwd']!r}: {exc}", file=sys.stderr)
        _finish(1)
    _forget_server_state()
    _finish(_run(msg["module"], msg["target"], msg["args"]))


def _forget_server_state() -> None:
    """Undo what the prewarm imports settled that a fresh interpreter settles on its own.

    Random generators: fresh interpreters seed them from the OS, forks would share one state
    (`random` reseeds itself after fork; torch's CPU generator and numpy's global RandomState
    do not). `tempfile`'s directory: computed from the server's environment if an import asked.
    """
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None:
            torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    with contextlib.suppress(Exception):
        if numpy_random is not None:
            numpy_random.seed()


class _NoSuchModule(Exception):
    """Raised by runpy's module lookup, as `python -m` reports it."""


def _run(module: bool, target: str, args: list[str]) -> int | str:
    """Run the target as `python -u [-m] target args` would; its exit code, or "SIGINT"."""
    import runpy

    sys.orig_argv = [sys.executable, "-u", *(["-m"] if module else []), target, *args]
    try:
        if module:
            sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            lookup = getattr(runpy, "_get_module_details", None)
            if lookup is not None:
                try:
                    lookup(target, _NoSuchModule)  # what `python -m` says for a missing module
                except _NoSuchModule as exc:
                    print(f"{sys.executable}: {exc}", file=sys.stderr)
                    return 1
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(target)
            try:
                with open(path, "rb") as f:
                    source: bytes | None = f.read()
            except IsADirectoryError:
                source = None
            except OSError as exc:
                print(
                    f"{sys.executable}: can't open file {path!r}: "
                    f"[Errno {exc.errno}] {exc.strerror}",
                    file=sys.stderr,
                )
                return 2
            sys.argv = [target, *args]
            if source is None or _is_zip(path):  # a directory or zip app with a __main__.py
                sys.path[0] = path
                runpy.run_path(path, run_name="__main__")
            else:
                sys.path[0] = os.path.dirname(os.path.realpath(path))
                _exec_main(path, source)
    except SystemExit as exc:
        return _system_exit_code(exc)
    except KeyboardInterrupt as exc:
        _report(exc)
        return "SIGINT"
    except BaseException as exc:
        _report(exc)
        return 1
    return 0


def _exec_main(path: str, source: bytes) -> None:
    """Run a script as python does: in a new `__main__` module that stays `sys.modules`'s.

    Not runpy.run_path: that sets sys.argv[0] to the path it is given (python keeps it as
    typed, and makes `__file__` absolute) and lends `__main__` only while the code runs (python's
    stays for threads and atexit hooks, which may pickle or spawn by `__main__`).
    """
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", path),
        __spec__=None,
        __package__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _report(exc: BaseException) -> None:
    """Print an uncaught exception as python would: without this module's and runpy's frames."""
    import runpy

    ours = {__file__, "<frozen runpy>", getattr(runpy, "__file__", None)}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    exc.__traceback__ = tb  # the default hook prints the exception's own traceback
    sys.excepthook(type(exc), exc, tb)


def _system_exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _finish(code: int | str) -> None:
    """End like the interpreter: join threads, atexit, flush stdio; never returns."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BaseException:
        code = 120  # what python exits with when flushing stdout fails
    with contextlib.suppress(BaseException):
        sys.stderr.flush()
    if code == "SIGINT":  # python ends an uncaught KeyboardInterrupt by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    os._exit(int(code))


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
    fd, parent, path0 = -1, None, None
    args = list(argv)
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--":
            break
        if not args:
            raise SystemExit(f"usage: {flag} needs a value")
        value = args.pop(0)
        if flag == "--fd":
            fd = int(value)
        elif flag == "--parent":
            parent = int(value)
        elif flag == "--path0":
            path0 = value
        else:
            raise SystemExit(f"usage: unknown option {flag}")
    if fd < 0:
        raise SystemExit("usage: python -m ftrun.agent.prewarm.forkserver --fd N [MODULE...]")
    return fd, parent, path0, args


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
