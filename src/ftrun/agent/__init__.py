"""The per-node agent: rendezvous, start, watch, stop, restart or exit."""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ftrun.errors import ExitCode, FtrunError

if TYPE_CHECKING:
    from ftrun.agent.loop.inbox import SignalRecorder
    from ftrun.agent.prewarm.client import ForkServer
    from ftrun.config.launch import LaunchConfig
    from ftrun.services import ServiceFactory

log = logging.getLogger("ftrun.agent")


def run_node(
    config: LaunchConfig,
    environ: Mapping[str, str],
    signals: SignalRecorder,
    fork_server: ForkServer | None = None,
    subsystems: Sequence[ServiceFactory] = (),
) -> ExitCode:
    """Run this node's part of the job to the end; returns the launcher's exit code.

    `environ` is what the workers inherit (before the launcher's own adjustments); `signals`
    records the launcher's signals into the agent's inbox (installed before torch's import);
    `fork_server`, the node's if the CLI started it with torch's import (closed here);
    `subsystems`, the builder's service factories (`open_runtime`).
    """
    if signals.last is not None:  # preempted while importing: nothing runs yet, leave now
        if fork_server is not None:
            fork_server.close()
        log.error("exiting with 75 (PREEMPTED): %s before any worker started",
                  signal.Signals(signals.last).name)  # fmt: skip
        return ExitCode.PREEMPTED
    from ftrun.agent.loop.node import NodeAgent
    from ftrun.agent.loop.runtime import open_runtime

    try:
        with open_runtime(
            config, environ, signals.inbox, fork_server, subsystems, signals.received
        ) as runtime:
            return NodeAgent(runtime, signals).run()
    except FtrunError as exc:
        log.error("%s", exc)
        return exc.exit_code
