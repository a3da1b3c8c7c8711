"""Prewarmed workers as a node service: the node's fork server imports `--ft-prewarm-modules`
once, at launch, and every worker of every cycle is forked from it. Where it cannot serve (a
non-Python entrypoint, a worker environment that differs in what is read at interpreter start,
a dead or unsafe server) workers are spawned plainly, and the log says why once."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

from ftrun.agent.prewarm.client import ForkServer, ForkServerError
from ftrun.agent.prewarm.target import PythonTarget
from ftrun.agent.services import NodeService
from ftrun.agent.workers import PlainSpawner, WorkerProcess

log = logging.getLogger("ftrun.agent")


class PrewarmService(NodeService):
    name = "prewarm"

    def __init__(
        self,
        target: PythonTarget,
        modules: Sequence[str],
        env: Mapping[str, str],
        plain: PlainSpawner,
    ) -> None:
        self._target = target
        self._plain = plain
        self._server = ForkServer.start(modules, env, target=target)
        self._fallback_said = False

    def spawn(self, env: Mapping[str, str], announce: Callable[[int], None]) -> WorkerProcess:
        try:
            return self._server.spawn(self._target, env, os.getcwd(), announce=announce)
        except ForkServerError as exc:
            if not self._fallback_said:
                self._fallback_said = True
                log.warning("starting workers without the fork server: %s", exc)
            return self._plain.spawn(env, announce)

    def kept_pids(self) -> frozenset[int]:
        return frozenset({self._server.pid})

    def close(self) -> None:
        self._server.close()
