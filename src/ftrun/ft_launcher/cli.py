"""`ft_launcher` entry point: parse, validate, set up logging, run this node's agent.

Usage errors end the process with one line on stderr (`ft_launcher: error: ...`) and exit
status 2 (`ExitCode.USAGE`); `--help` prints the option reference and exits 0.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from ftrun.errors import ConfigError, ExitCode, FtrunError
from ftrun.ft_launcher.config import LaunchConfig, config_from
from ftrun.ft_launcher.options import PROG, help_text, parse_argv

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
    except ConfigError as err:
        _usage_error(str(err))
    setup_logging(config, os.environ)
    for warning in config.warnings:
        log.warning("%s", warning)
    from ftrun.agent import run_node  # the agent (and torch) only once the config is valid

    try:
        code = run_node(config)
    except FtrunError as err:
        log.error("%s", err)
        sys.exit(int(err.exit_code))
    sys.exit(int(code))


def _usage_error(message: str) -> NoReturn:
    """One line on stderr, exit status 2: no traceback, no usage block."""
    sys.stderr.write(f"{PROG}: error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    sys.exit(ExitCode.USAGE)


def node_name(config: LaunchConfig, environ: Mapping[str, str]) -> str:
    """This node's name in logs: the configured one, else Slurm's, else the host name."""
    return config.agent.node_name or environ.get("SLURMD_NODENAME") or socket.gethostname()


def setup_logging(config: LaunchConfig, environ: Mapping[str, str]) -> None:
    """Root logging to stderr at `--ft-log-level`, every line prefixed `[ft_launcher <node>]`."""
    prefix = f"[{PROG} {node_name(config, environ)}]".replace("%", "%%")
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
