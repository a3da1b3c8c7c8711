"""In a freshly forked child of the fork server: become the worker and run it like python.

Everything the server changed is undone (signals, fds, environment, cwd, native thread pools,
random seeds), the worker takes its --numa-binding, the start-up marks are armed (`marks.py`),
then runpy or exec runs the target, and the process ends as the interpreter would. A prestarted
child (`cuda_device` set: `prestart.py`) makes its CUDA context first and then waits for the
agent's "go", which brings the environment of the cycle it runs in (and imports, meanwhile,
what the agent's "preload" names). Standard library only, like the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Protocol

from ftrun.agent.placement.binding import apply_binding
from ftrun.agent.prewarm import marks
from ftrun.agent.prewarm.pools import restore_thread_pools
from ftrun.agent.prewarm.wire import close_fds, read_gate
from ftrun.agent.termination import die_with_parent

CHILD_BROKEN = 70
"""Exit code of a child that could not become the worker (EX_SOFTWARE)."""


class ServerState(Protocol):
    """What the child needs to know of the server it was forked from."""

    pid: int
    initial_handlers: dict[int, Any]
    initial_mask: set[int]
    keep_fds: frozenset[int]


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def is_open(fd: int) -> bool:
    """Whether `fd` is open still (not the one that listed /proc/self/fd, say)."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ---- becoming the worker --------------------------------------------------------------------


def become_worker(server: ServerState, msg: dict[str, Any], fds: list[int]) -> None:
    """Turn this fresh fork into the worker and run it; never returns."""
    os.setsid()
    die_with_parent()  # through a libc loaded at import: no dlopen between fork and run
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
    close_fds(*(open_fds() - {0, 1, 2, *gate, *server.keep_fds}))
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    for stream in (sys.stdout, sys.stderr):  # as `python -u` makes them
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=False, write_through=True)  # type: ignore[union-attr]
    if msg["cuda_device"] is not None:  # prestarted: made ready now, run on the agent's "go"
        _settle(msg["env"], msg["cwd"])
        make_cuda_context(msg["cuda_device"])
        env = read_gate(gate[0], preload=_import_quietly)
        if env is None:
            os._exit(CHILD_BROKEN)  # the agent withdrew the start (or died)
        os.close(gate[0])
        os.environ.clear()
        os.environ.update(env)  # the binding's and the pools' variables are the same (agent)
    else:
        if gate and os.read(gate[0], 1) != b"g":
            os._exit(CHILD_BROKEN)  # the agent withdrew the start (or died)
        for fd in gate:
            os.close(fd)
        _settle(msg["env"], msg["cwd"])
    _forget_server_state()
    marks.install(os.environ)
    _finish(_run(msg["module"], msg["target"], msg["args"]))


def _settle(env: dict[str, str], cwd: str) -> None:
    """The worker's environment, cwd, --numa-binding and thread pools."""
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(cwd)
    except OSError as exc:
        print(f"ftrun fork server: cannot chdir to {cwd!r}: {exc}", file=sys.stderr)
        _finish(1)
    apply_binding(os.environ)  # first: the thread pools are sized from the bound CPUs
    restore_thread_pools(os.environ)


def make_cuda_context(device: int) -> None:
    """Create the CUDA context on `device` (1.1-1.3 s on an H200 host, paid before the restart
    rather than in it), leaving torch's current device where a fresh process has it: no
    context is made on device 0 for it, and the script's `set_device` finds this one. A node
    without CUDA, or without that device, makes none; the script then fails or not as it
    would have."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with contextlib.suppress(Exception):
        if device < torch.cuda.device_count():
            # cudaSetDevice makes the primary context (CUDA >= 12); leaving the guard puts back
            # device 0 without making a context there (torch's MaybeExchangeDevice).
            with torch.cuda.device(device):
                pass


def _import_quietly(modules: list[str]) -> None:
    """Import what the agent expects the script to import (a prestarted worker, while it waits).
    A module that fails is left for the script to import, and fail on, itself."""
    import importlib

    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _forget_server_state() -> None:
    """Undo what the prewarm imports settled that a fresh interpreter settles on its own.

    Random generators: fresh interpreters seed them from the OS, forks would share one state
    (`random` reseeds itself after fork; torch's CPU generator and numpy's global RandomState
    do not). `tempfile`'s directory: computed from the server's environment if an import asked.
    """
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None
    with contextlib.suppress(Exception):  # KeyError: not imported, nothing to reseed
        sys.modules["torch"].default_generator.seed()
    with contextlib.suppress(Exception):
        sys.modules["numpy.random"].seed()


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
                print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] "
                      f"{exc.strerror}", file=sys.stderr)  # fmt: skip
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
    main.__dict__.update(__file__=path, __cached__=None, __spec__=None, __package__=None,
                         __loader__=SourceFileLoader("__main__", path),
                         __builtins__=builtins)  # fmt: skip
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
