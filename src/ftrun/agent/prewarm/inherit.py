"""In a fork of the agent (`launch.fork_server`): forget the agent, become the fork server.

What `python -u -m ftrun.agent.prewarm.forkserver` would have started with is made true here:
its own session, SIGKILL when the agent dies, stdin and stdout on /dev/null and no fd of the
agent's but stderr and the socket end, stdio unbuffered as `-u` makes it, the signal handlers
a fresh interpreter has (the agent's only record into its inbox: a server keeping them would
shrug off SIGTERM), none of the agent's logging set-up (a worker's `logging.basicConfig` would
find the agent's root handler and do nothing), faulthandler as PYTHONFAULTHANDLER says, the
server's environment, a `__main__` and sys.argv of its own, and of the launcher's own modules
only those the server runs on (a worker importing the client library imports it afresh, as it
would from a spawned server, not the agent's copy, made with the agent's environment). The
other modules the agent imported (torch) stay: that is the point. Then the server's `main` runs
as the spawned server's does: it checks that the agent still lives, takes `path0` as
sys.path[0], imports the prewarm modules the agent did not import, and serves until EOF. The
process ends with `os._exit`, never returning.
"""

from __future__ import annotations

import builtins
import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import NoReturn

from ftrun.agent.prewarm import forkserver
from ftrun.agent.prewarm.child import CHILD_BROKEN, open_fds
from ftrun.agent.prewarm.pools import SERVER_ONLY_ENV
from ftrun.agent.prewarm.wire import close_fds
from ftrun.agent.termination import die_with_parent

__all__ = ["CHILD_BROKEN", "serve"]


def serve(
    fd: int, parent: int, path0: str, modules: Sequence[str], env: Mapping[str, str]
) -> NoReturn:
    """Become the server on socket `fd` for agent `parent`, and exit when it is done."""
    code = CHILD_BROKEN
    try:
        os.setsid()
        die_with_parent()  # forkserver.main then checks that `parent` did not die before this
        _forget_signals()
        _forget_logging()  # before the fds go: a handler closes its own file
        _forget_fds(fd)
        _unbuffered_stdio()
        _forget_process(env)
        argv = ["--fd", str(fd), "--parent", str(parent), "--path0", path0, "--", *modules]
        code = forkserver.main(argv)
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(2, f"ftrun fork server (forked):\n{traceback.format_exc()}".encode())
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def _forget_signals() -> None:
    """Each handler the agent set goes back to what a fresh interpreter has."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                fresh = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                signal.signal(signum, fresh)


def _forget_logging() -> None:
    """The root logger and ftrun's own loggers as a fresh interpreter has them (the agent gave
    `ftrun` its handler and stopped its propagation: a worker's `ftrun.inprocess` warnings would
    go nowhere). Handlers on other loggers were added by the imported modules themselves
    (torch's), as they would be in a spawned server."""
    root = logging.getLogger()
    ours = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
            if name == "ftrun" or name.startswith("ftrun.")]  # fmt: skip
    for logger in (root, *ours):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            with contextlib.suppress(Exception):
                handler.close()
        logger.setLevel(logging.NOTSET)
        logger.propagate, logger.disabled = True, False
    root.setLevel(logging.WARNING)


def _forget_fds(sock_fd: int) -> None:
    """stdin and stdout on /dev/null, stderr kept; every other fd of the agent's closed."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    close_fds(*(open_fds() - {0, 1, 2, sock_fd}))


def _unbuffered_stdio() -> None:
    """sys.stdout and sys.stderr as `python -u` makes them: the agent's may buffer (a forked
    worker's output would then wait for a flush). Handlers that wrote to the old streams (the
    imported modules', created with sys.stderr) write to the new ones."""
    replaced: dict[int, io.TextIOWrapper] = {}
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, f"__{name}__")
        if old is None:
            continue
        raw = io.FileIO(fd, "w", closefd=False)
        raw.name = f"<{name}>"  # type: ignore[misc]
        new = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors,  # type: ignore[arg-type]
                               newline="\n", write_through=True)  # fmt: skip
        new.mode = "w"  # type: ignore[misc]
        setattr(sys, f"__{name}__", new)
        setattr(sys, name, new)
        replaced[id(old)] = new
    for ref in list(logging._handlerList):  # type: ignore[attr-defined]
        handler = ref()
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and id(stream) in replaced:
            handler.setStream(replaced[id(stream)])


def _forget_process(env: Mapping[str, str]) -> None:
    """The server's environment (with its thread limits), faulthandler as a fresh interpreter
    with `env` would have it, and a `__main__` and sys.argv that are not the launcher's."""
    os.environ.clear()
    os.environ.update({**env, **SERVER_ONLY_ENV})
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    sys.argv = [forkserver.__file__]
    _forget_agent_modules()


def _forget_agent_modules() -> None:
    """Unload the `ftrun` modules that the server does not run on: a later import runs them
    afresh. Only ours (plain Python, importable twice); torch and the other libraries stay."""
    keep = _used_by(forkserver) - {forkserver.__name__}  # a spawned one runs it as __main__
    for name in [n for n in sys.modules if n.partition(".")[0] == "ftrun" and n not in keep]:
        module = sys.modules.pop(name)
        package, _, attribute = name.rpartition(".")
        parent = sys.modules.get(package)
        if parent is not None and getattr(parent, attribute, None) is module:
            delattr(parent, attribute)  # else `from package import it` finds the old one


def _used_by(root: types.ModuleType) -> set[str]:
    """The `ftrun` modules `root` runs on: those its globals come from, transitively, and
    their packages (not a package's submodules that were imported after it: the agent's)."""
    seen: set[str] = set()
    todo: list[object] = [root.__name__]
    while todo:
        name = todo.pop()
        if not isinstance(name, str) or name in seen or name.partition(".")[0] != "ftrun":
            continue
        module = sys.modules.get(name)
        if module is None:
            continue
        seen.add(name)
        todo.append(name.rpartition(".")[0])
        for value in vars(module).values():
            if isinstance(value, types.ModuleType):
                if not value.__name__.startswith(f"{name}."):
                    todo.append(value.__name__)
            else:  # a function's or class's module, and an instance's class's
                todo += [getattr(value, "__module__", None), type(value).__module__]
    return seen
