"""`ft_launcher` entry point: parse, validate, set up logging, run this node's agent.

Usage errors end the process with one line on stderr (`ft_launcher: error: ...`) and exit
status 2 (`ExitCode.USAGE`); `--help` prints the option reference and exits 0.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import queue
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from ftrun.agent.loop.inbox import SignalRecorder
from ftrun.agent.node_services.compile_cache import prepare_compile_caches
from ftrun.agent.prewarm.service import start_with_torch
from ftrun.config.launch import LaunchConfig
from ftrun.errors import ConfigError, ExitCode, FtrunError, exit_status
from ftrun.eventlog.writer import log_dir_error
from ftrun.ft_launcher.build import config_from
from ftrun.ft_launcher.command_line import help_text, parse_argv
from ftrun.ft_launcher.options import PROG

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run `ft_launcher` with `argv` (default: `sys.argv[1:]`); never returns."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        line = parse_argv(args)
        if line.help:
            sys.stdout.write(help_text())
            sys.exit(ExitCode.SUCCESS)
        config = config_from(line, os.environ)
        _check_entrypoint(config.agent.entrypoint, os.environ)
        _make_log_dir(config)
    except ConfigError as err:
        _usage_error(str(err))
    # Handlers only record (into the agent's inbox); preemption during torch's import is seen
    # as soon as the agent starts.
    signals = SignalRecorder(queue.SimpleQueue()).install(config.agent.signals_to_handle)
    setup_logging(config, os.environ)
    for warning in config.warnings:
        log.warning("%s", warning)
    workers_environ = {**os.environ, **prepare_compile_caches(os.environ)}
    # c10d logs every timed-out store wait and failed connect with a C++ backtrace; the agent
    # reports those conditions itself in one line. The workers keep the user's setting.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    # Torch's import, and the fork server forked right after it (it inherits the import):
    # before any thread starts.
    fork_server = start_with_torch(config, workers_environ, config.this_node(os.environ)[1])
    from ftrun.agent import run_node  # the agent (and torch) only once the config is valid
    from ftrun.checkpointing.keeper import keeper_service
    from ftrun.observe.service import observe_service
    from ftrun.rerun.service import rerun_service
    from ftrun.straggler.service import straggler_service

    try:
        # The subsystems' services, in start order: the agent imports none of them.
        subsystems = (observe_service, straggler_service, keeper_service, rerun_service)
        code = run_node(config, workers_environ, signals, fork_server, subsystems)
    except FtrunError as err:
        log.error("%s", err)
        code = err.exit_code
    finally:
        if fork_server is not None:
            fork_server.close()  # the runtime closed it already, unless it never got that far
    status = exit_status(code, config.agent.no_restart_exit_code)
    if status != code:
        log.error("exit %d (%s) is reported as %d (--ft-no-restart-exit-code)", code,
                  code.name, status)  # fmt: skip
    _leave(status)


def _check_entrypoint(command: Sequence[str], environ: Mapping[str, str]) -> None:
    """A script, module or program the workers cannot find is a usage error now, before any
    worker starts: else every rank fails to open it and the job spends its restart budget."""
    python = environ.get("PYTHON_EXEC") or sys.executable
    if command[0] != python or command[1:2] != ("-u",):  # --no-python: a program
        if shutil.which(command[0]) is None:
            raise ConfigError(f"{command[0]}: no such program (--no-python)")
    elif command[2] != "-m":
        if not os.path.isfile(command[2]):
            raise ConfigError(f"{command[2]}: no such file (SCRIPT, which every worker runs)")
    elif "PYTHON_EXEC" not in environ and not _module_found(command[3]):
        raise ConfigError(f"--module {command[3]}: no such module here (python -m finds none)")


def _module_found(name: str) -> bool:
    """Whether `python -m name` in this directory would find it, without running its code."""
    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
    spec = spec or importlib.util.find_spec(top)  # a top-level name runs nothing
    for depth in range(len(rest)):
        if spec is None or spec.submodule_search_locations is None:
            return False
        full = ".".join([top, *rest[: depth + 1]])
        spec = importlib.machinery.PathFinder.find_spec(full, spec.submodule_search_locations)
    return spec is not None


def _make_log_dir(config: LaunchConfig) -> None:
    """Create --log-dir now: one that cannot be is a usage error before torch's import (2 s),
    not after it. The agent creates its node's directory under it later."""
    log_dir = config.agent.log_dir
    if log_dir is None:
        return
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise log_dir_error(log_dir, exc) from None


def _leave(code: int) -> NoReturn:
    """Exit without interpreter finalization: the agent has cleaned up after itself, and a
    native thread still blocked in c10d (an abandoned store handshake) would abort the
    process if the interpreter tore down under it."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _usage_error(message: str) -> NoReturn:
    """One line on stderr, exit status 2: no traceback, no usage block."""
    sys.stderr.write(f"{PROG}: error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    sys.exit(ExitCode.USAGE)


def setup_logging(config: LaunchConfig, environ: Mapping[str, str]) -> None:
    """Root logging to stderr at `--ft-log-level`, every line prefixed `[ft_launcher <node>]`."""
    prefix = f"[{PROG} {config.this_node(environ)[1]}]".replace("%", "%%")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.log_level)


if __name__ == "__main__":
    main()
