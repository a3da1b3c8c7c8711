"""Prewarmed workers as a node service.

The node's fork server starts with the launcher (`start_with_torch`, from the CLI): forked from
the launcher right after the launcher's own import of torch, which the server then inherits
instead of importing torch a second time (`launch.py`); where a fork could not stand in for a
fresh server, spawned before that import, so that the two imports overlap. It has
`--ft-prewarm-modules` imported (what every worker imports anyway: the first cycle waits for
these alone), and once the first cycle's workers have started it imports
`--ft-prewarm-deep-modules` too (torch._dynamo, which brings triton and inductor: DDP imports it
in each worker).

With `--ft-prestart-workers` (on where the node has a GPU) it also keeps, between restarts, one
worker per local rank forked with its CUDA context made (`prestart.py`): a restarted rank
starts there.

Where it cannot serve (a non-Python entrypoint, a worker environment that differs in what is
read at interpreter start, a dead or unsafe server) workers are spawned plainly. Each cycle
says once which way its workers started, and why (`cycle_path`). A server that a deep import
made unforkable, or that died, is replaced at the next round by a fresh one (without the deep
modules if those broke it), at most `MAX_REPLACEMENTS` times; that round's workers wait for its
first imports, which a plain worker would pay for too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from ftrun.agent.prewarm import launch
from ftrun.agent.prewarm.client import ForkServer, ForkServerError
from ftrun.agent.prewarm.pools import SERVER_ONLY_ENV
from ftrun.agent.prewarm.prestart import HeldWorker, PrestartPool
from ftrun.agent.prewarm.start_env import path0
from ftrun.agent.prewarm.target import PythonTarget, python_target
from ftrun.agent.worker_env import shared_env
from ftrun.agent.workers import PlainSpawner, SpawnPath, WorkerProcess
from ftrun.config.launch import LaunchConfig
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService

log = logging.getLogger("ftrun.agent")

MAX_REPLACEMENTS = 2
"""Fresh servers started after the first one broke: a server that keeps breaking is not
replaced forever (each costs a full import)."""


def start_with_torch(
    config: LaunchConfig, environ: Mapping[str, str], node: str
) -> ForkServer | None:
    """Import torch for the agent, and start the node's fork server: forked right after that
    import where a fork can stand in for a spawned server (`launch.fork_blocker`), else
    spawned before it. None where workers will not be forked (`plain_reason`); torch is then
    left for the agent's own imports. The caller must not have started a thread."""
    target = python_target(config.agent.entrypoint)
    modules = config.agent.prewarm_modules
    if target is None or not modules:
        return None
    env = shared_env(config, environ, {}, None, node)
    why = launch.fork_blocker(modules, env, path0(target), planned=launch.AGENT_IMPORTS)
    if why is not None:
        log.info("fork server: spawned before the agent imports torch, not forked: %s", why)
        return start_early(config, environ, node)
    agent_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    with launch.environment({**env, **SERVER_ONLY_ENV}):  # torch reads what the server's would
        import torch.distributed  # noqa: F401 - the agent's store needs it; the server inherits it
    server = _start(modules, env, target, fork=True)
    # The agent's own C++ log level, which torch could not read at its import (after the fork:
    # the server and its workers keep the workers' level).
    if agent_level is not None and agent_level != env.get("TORCH_CPP_LOG_LEVEL"):
        launch.set_cpp_log_level(agent_level)
    return server


def start_early(config: LaunchConfig, environ: Mapping[str, str], node: str) -> ForkServer | None:
    """The node's fork server, spawned now (whatever the agent imported, whatever threads it
    runs); None where workers will not be forked (the reason is said by `plain_reason`)."""
    target = python_target(config.agent.entrypoint)
    if target is None or not config.agent.prewarm_modules:
        return None
    env = shared_env(config, environ, {}, None, node)
    return _start(config.agent.prewarm_modules, env, target, fork=False)


def _start(
    modules: Sequence[str], env: Mapping[str, str], target: PythonTarget, fork: bool
) -> ForkServer | None:
    try:
        return ForkServer.start(modules, env, target=target, fork=fork)
    except ForkServerError as exc:
        log.warning("starting workers without the fork server: %s", exc)
        return None


def plain_reason(config: LaunchConfig) -> str:
    """Why a node without a fork server spawns each worker fresh."""
    if not config.agent.prewarm_modules:
        return "--ft-prewarm-modules=none"
    return "the entrypoint is not `python -u` with the launcher's interpreter (--no-python?)"


class PrewarmService(NodeService):
    name = "prewarm"

    def __init__(
        self,
        server: ForkServer,
        target: PythonTarget,
        deep_modules: Sequence[str],
        env: Mapping[str, str],
        plain: PlainSpawner,
        prestart: bool = False,
    ) -> None:
        self._server = server
        self._target = target
        self._deep = tuple(deep_modules)
        self._env = dict(env)
        self._plain = plain
        self._prestarted = PrestartPool(self._hold) if prestart else None
        self._replacements = 0
        self._paths: dict[int, str] = {}  # pid -> "forked" | "spawned", this cycle
        self._why: str | None = None  # why this cycle spawned plainly

    def on_round(self, rnd: Round) -> None:
        self._paths, self._why = {}, None
        if self._server.error is not None and self._replacements < MAX_REPLACEMENTS:
            self._replace()

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        """Deepen once the cycle's workers run: the import overlaps their start-up."""
        if self._deep and self._server.deepen(self._deep):
            log.info("fork server: importing %s between cycles", ",".join(self._deep))
        if self._prestarted is not None:
            self._prestarted.refill_later()

    def spawn(self, env: Mapping[str, str], announce: Callable[[int], None]) -> WorkerProcess:
        if self._prestarted is None:
            return self._fork(env, announce)
        held = self._prestarted.take(env)
        self._prestarted.remember(env)
        if held is None:
            return self._fork(env, announce)
        try:
            announce(held.worker.pid)
        except BaseException:
            held.discard()
            raise
        held.release(env)
        self._paths[held.worker.pid] = "forked"
        # For a replacement of one rank (the in-process tier) no cycle starts: make its next.
        self._prestarted.refill_later()
        return held.worker

    def _hold(self, env: Mapping[str, str], cuda_device: int) -> HeldWorker:
        worker, gate = self._server.prestart(self._target, env, os.getcwd(), cuda_device)
        return HeldWorker(worker, gate, env)

    def _fork(self, env: Mapping[str, str], announce: Callable[[int], None]) -> WorkerProcess:
        try:
            worker: WorkerProcess = self._server.spawn(
                self._target, env, os.getcwd(), announce=announce
            )
        except ForkServerError as exc:
            self._why = self._why or str(exc)
            worker = self._plain.spawn(env, announce)
            self._paths[worker.pid] = "spawned"
        else:
            self._paths[worker.pid] = "forked"
        return worker

    def cycle_path(self) -> SpawnPath:
        paths = set(self._paths.values())
        path = paths.pop() if len(paths) == 1 else "mixed" if paths else "none"
        return SpawnPath(path, self._why)

    def kept_pids(self) -> frozenset[int]:
        held = self._prestarted.pids() if self._prestarted is not None else frozenset()
        return held | {self._server.pid}

    def close(self) -> None:
        if self._prestarted is not None:
            self._prestarted.close()
        self._server.close()

    def _replace(self) -> None:
        """A fresh server in place of a broken one (without the deep modules if those broke
        it)."""
        broken = self._server
        if broken.deepen_broke:
            self._deep = ()
        self._replacements += 1
        try:
            fresh = ForkServer.start(broken.modules_at_start, self._env, target=self._target)
        except ForkServerError as exc:
            log.warning("cannot replace the fork server: %s", exc)
            return
        broken.close()
        self._server = fresh
        log.warning("fork server replaced (%s)%s", broken.error,
                    "" if self._deep else " (without deep imports)")  # fmt: skip
