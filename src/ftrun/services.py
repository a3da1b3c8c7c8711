"""Node services: components that live as long as the node agent and hook into its cycles.

A feature that needs the node's lifetime (the rank monitor, health checks, prewarmed workers,
GPU memory reclaim, the checkpoint keeper, the straggler collector) is a `NodeService`, not a
new branch in the agent loop. A service overrides the hooks it needs:

- `before_round()`     before every rendezvous; raise `NodeUnhealthyError` to keep the node out
- `worker_env(round)`  variables added to every worker's environment for that round
- `on_round(round)`    after the rendezvous, before the workers start (e.g. fetch what they need)
- `on_stopped(round, pids)`  after a cycle's workers are gone (e.g. wait for their GPU memory)
- `on_finished(round)` once every local worker of the round exited 0, before the exit barrier
- `kept_pids()`        processes of the service that the agent's stop routine must not signal
- `close()`            once, at the end; must not raise

A service that needs the workload to change (the straggler detector excluding its node) posts
a `ServiceRequest` on the agent's inbox: the agent treats it as a worker's control request.

`NodeServices` starts them in order and closes them in reverse, also when a later one fails to
start: whatever was started is closed (an `ExitStack`).

Subsystems (`checkpointing`, `straggler`) are never imported by the agent: the builder
(`ft_launcher`) hands `open_runtime` their `ServiceFactory`s, each called once with the node's
`ServiceContext`. This module sits below the agent and the subsystems alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ftrun.rank_monitor.workload import WorkloadAction
from ftrun.rendezvous.ranks import Round

if TYPE_CHECKING:
    from torch.distributed import Store

    from ftrun.config.launch import LaunchConfig
    from ftrun.nvml import GpuSnapshot
    from ftrun.peer import PeerClient, PeerServer
    from ftrun.rank_monitor.records import ProgressSnapshot
    from ftrun.rank_monitor.timings import TimingBatch

log = logging.getLogger("ftrun.agent")

Emit = Callable[..., None]
"""Writes one of this node's events: `emit(name, **fields)` (`EventLog.emit`)."""
Post = Callable[[object], None]
"""Puts an item on the agent's inbox."""


@dataclasses.dataclass(frozen=True)
class ServiceRequest:
    """A node service asks the agent for a workload action while the workers run."""

    service: str
    action: WorkloadAction
    reason: str


class NodeService:
    """Base class: every hook is a no-op; override what the service needs."""

    name = "service"

    def before_round(self) -> None:
        return None

    def worker_env(self, rnd: Round) -> Mapping[str, str]:
        return {}

    def on_round(self, rnd: Round) -> None:
        return None

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        """The round's local workers have all been started (pids in local-rank order)."""
        return None

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        return None

    def on_finished(self, rnd: Round) -> None:
        return None

    def kept_pids(self) -> frozenset[int]:
        return frozenset()

    def close(self) -> None:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceContext:
    """What a subsystem's service may use: the node's shared collaborators, nothing of the
    agent's own. Built by keyword, once, in `agent.runtime.open_runtime`."""

    config: LaunchConfig
    store: Store
    node: str
    job_dir: Path
    """The per-job 0700 directory for IPC."""
    log_dir: Path
    emit: Emit
    post: Post
    """Puts a `ServiceRequest` on the agent's inbox."""
    peer_server: PeerServer
    peer_client: PeerClient
    observe_timings: Callable[[Callable[[TimingBatch], None]], None]
    """Registers a callback for the section timings the rank monitor receives (called from
    the monitor's thread: it must only queue them)."""
    read_events: Callable[[Callable[[Mapping[str, object]], None]], None]
    """Registers a reader of every event this node writes from now on (`EventLog.subscribe`)."""
    progress: Callable[[], list[ProgressSnapshot]]
    """Where the node's ranks got to now (the rank monitor's `progress_snapshot`)."""
    describe: Callable[[str, object], None]
    """Sets a field of the cycle info every worker reads (`FTRUN_CYCLE_INFO`) from the next
    round on (None removes it)."""
    gpus: Callable[[], Sequence[GpuSnapshot]] = tuple
    """What the health watch last read of each of the node's GPUs (empty without one)."""


ServiceFactory = Callable[[ServiceContext], NodeService]
"""Builds one subsystem's service; `open_runtime` calls each once, in order."""


S = TypeVar("S", bound=NodeService)


class NodeServices:
    """The node's services in start order; hooks run in that order, `close` in reverse."""

    def __init__(self) -> None:
        self._services: list[NodeService] = []
        self._stack = contextlib.ExitStack()

    def add(self, service: S) -> S:
        """Register a started service; from now on `close` closes it."""
        self._services.append(service)
        self._stack.callback(_close_quietly, service)
        return service

    def before_round(self) -> None:
        for service in self._services:
            service.before_round()

    def worker_env(self, rnd: Round) -> dict[str, str]:
        return {k: v for service in self._services for k, v in service.worker_env(rnd).items()}

    def on_round(self, rnd: Round) -> None:
        for service in self._services:
            service.on_round(rnd)

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        started = tuple(pids)
        for service in self._services:
            service.on_started(rnd, started)

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        stopped = tuple(pids)
        for service in self._services:
            service.on_stopped(rnd, stopped)

    def on_finished(self, rnd: Round) -> None:
        for service in self._services:
            service.on_finished(rnd)

    def kept_pids(self) -> frozenset[int]:
        return frozenset().union(*(service.kept_pids() for service in self._services))

    def close(self) -> None:
        self._services.clear()
        self._stack.close()


def _close_quietly(service: NodeService) -> None:
    """A service that fails to close must not keep the others from closing."""
    try:
        service.close()
    except Exception:
        log.exception("closing the %s service failed", service.name)
