"""The per-node agent: rendezvous, start, watch, stop, restart or exit."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ftrun.errors import ExitCode, FtrunError

if TYPE_CHECKING:
    from ftrun.config import LaunchConfig

log = logging.getLogger("ftrun.agent")


def run_node(config: LaunchConfig, environ: Mapping[str, str]) -> ExitCode:
    """Run this node's part of the job to the end; returns the launcher's exit code.

    `environ` is what the workers inherit (before the launcher's own adjustments).
    """
    from ftrun.agent.node import NodeAgent
    from ftrun.agent.runtime import open_runtime

    try:
        with open_runtime(config, environ) as runtime:
            return NodeAgent(runtime).run()
    except FtrunError as exc:
        log.error("%s", exc)
        return exc.exit_code
