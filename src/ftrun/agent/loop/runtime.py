"""What one agent holds for the life of a job, built in one place and closed in one place.

`open_runtime` builds the node's identity, events file, store connection, rendezvous and node
services (`ftrun.services`) in order, each registered for closing the moment it exists: a
failure halfway through start-up closes what was started, in reverse order. The subsystems'
services (the checkpoint keeper, the straggler detector) come from the factories the builder
passes in: the agent imports no subsystem. The NodeAgent's steps use the runtime and never
build anything themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import queue
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from torch.distributed import Store

from ftrun import owned_dir
from ftrun.agent.node_services import restart_watch
from ftrun.agent.node_services.cycle_info import CycleInfoService
from ftrun.agent.node_services.gpu_memory import GpuReclaimService
from ftrun.agent.node_services.health import HealthService
from ftrun.agent.node_services.health_watch import HealthWatch
from ftrun.agent.node_services.inprocess_link import InprocessLink
from ftrun.agent.node_services.monitoring import MonitorService
from ftrun.agent.node_services.neighbour_watch import NeighbourWatch
from ftrun.agent.node_services.peering import PeerService
from ftrun.agent.node_services.worker_store import WorkerStoreService
from ftrun.agent.prewarm.client import ForkServer
from ftrun.agent.prewarm.service import PrewarmService, plain_reason, start_early
from ftrun.agent.prewarm.target import python_target
from ftrun.agent.worker_env import shared_env
from ftrun.agent.workers import PlainSpawner, Spawner
from ftrun.config.launch import LaunchConfig
from ftrun.errors import NodeUnhealthyError, RendezvousFailedError
from ftrun.eventlog.writer import EventLog, log_dir_error
from ftrun.identity import free_port
from ftrun.nvml import GpuSnapshot
from ftrun.rank_monitor import ProgressSnapshot, RankMonitorServer
from ftrun.rank_monitor.timings import TimingBatch
from ftrun.rendezvous.control import JobControl, wait_until
from ftrun.rendezvous.factory import NodeRendezvous, create_rendezvous
from ftrun.rendezvous.ranks import NodeDescriptor, Round, infra_rank_from_env
from ftrun.services import NodeServices, ServiceContext, ServiceFactory
from ftrun.store.connect import another_client, connect_store

log = logging.getLogger("ftrun.agent")


@dataclasses.dataclass(kw_only=True)
class AgentRuntime:
    """The agent's long-lived collaborators. Built by keyword, in one place for the launcher
    (`open_runtime`) and the tests' agent harness alike: the constructor also builds the
    rendezvous, which needs the runtime's own `descriptor` and `standing_by`."""

    config: LaunchConfig
    environ: Mapping[str, str]
    """What the workers inherit (before the launcher's own adjustments)."""
    host: str
    node: str
    node_log_dir: Path
    events: EventLog
    inbox: queue.SimpleQueue[object]
    store: Store
    is_store_host: bool
    infra_rank: int | None
    services: NodeServices
    monitor: RankMonitorServer
    spawner: Spawner
    peer_port: int
    job_dir: Path
    """The per-job 0700 directory for IPC (the workers' FTRUN_IPC_DIR)."""
    inprocess: InprocessLink
    """The wrapped ranks' view and the way to interrupt them (`agent.inprocess.link`)."""
    restore_peer: Callable[[], None]
    """Writes the job's peer secret back into a store that restarted (`PeerService.restore`)."""
    answers: dataclasses.InitVar[Callable[[NodeDescriptor], bool]]
    """Whether another node's agent still serves its peer channel (a hot spare's probe)."""
    rendezvous: NodeRendezvous = dataclasses.field(init=False)
    stood_by: tuple[int, int] | None = None
    """(cycle, its round's size) of the last round this node stood by in, as a hot spare."""

    def __post_init__(self, answers: Callable[[NodeDescriptor], bool]) -> None:
        self.rendezvous = create_rendezvous(
            self.config.rendezvous, self.store, self.descriptor, answers, self.standing_by
        )

    @property
    def control(self) -> JobControl:
        return self.rendezvous.control

    def descriptor(self) -> NodeDescriptor:
        return NodeDescriptor(
            node=self.node, host=self.host, local_world_size=self.config.agent.nproc_per_node,
            master_port=free_port(self.host), infra_rank=self.infra_rank, peer_port=self.peer_port,
        )  # fmt: skip

    def standing_by(self, cycle: int, active: tuple[str, ...]) -> None:
        self.stood_by = (cycle, len(active))
        self.events.cycle = cycle
        self.events.emit("standby", active=list(active))

    def restore_job_state(self, cycle: int) -> None:
        """Write what this node knows of the job into a store that restarted empty (`cycle`:
        the last this node took part in or waited for); see `JobControl.restore`."""
        self.control.restore(cycle)
        self.rendezvous.restore()
        self.restore_peer()

    def leave(self, rnd: Round | None, linger: float) -> None:
        """Say goodbye; the store host waits (bounded) until the last round's nodes did (they
        may still read why the job ends), also when it stood by in that round."""
        with contextlib.suppress(RuntimeError):
            self.control.mark_gone(self.node, "exited")
            if rnd is not None:
                self.control.arrive(rnd.number, "left")
            rounds = [self.stood_by] if self.stood_by else []
            rounds += [(rnd.number, len(rnd.nodes))] if rnd is not None else []
            if self.is_store_host and rounds:
                cycle, size = max(rounds)
                wait_until(lambda: self.control.count(cycle, "left") >= size, linger, 0.05)


@contextlib.contextmanager
def open_runtime(
    config: LaunchConfig,
    environ: Mapping[str, str],
    inbox: queue.SimpleQueue[object],
    fork_server: ForkServer | None = None,
    subsystems: Sequence[ServiceFactory] = (),
    interrupted: Callable[[], bool] = lambda: False,
) -> Iterator[AgentRuntime]:
    """`fork_server`: the node's, if the CLI started it (`prewarm.service.start_with_torch`);
    the runtime owns it from here on and closes it. `subsystems`: the builder's service
    factories, started in order after the node's own services they may use. `interrupted`:
    whether the launcher got a signal (a wait for a restarting store gives up then)."""
    host, node = config.this_node(environ)
    log_dir = config.agent.log_dir or Path(tempfile.mkdtemp(prefix="ftrun-logs-"))
    if config.agent.log_dir is None:
        log.info("logs and events in %s (--log-dir not given)", log_dir)
    with contextlib.ExitStack() as stack:
        if fork_server is not None:
            stack.callback(fork_server.close)
        events = stack.enter_context(contextlib.closing(_open_events(log_dir, node)))
        # The per-job 0700 directory for IPC (mkdtemp's mode): removed after every service.
        job_dir, lock = make_job_dir()
        if lock is not None:
            stack.callback(os.close, lock)
        stack.callback(shutil.rmtree, job_dir, ignore_errors=True)
        services = NodeServices()
        stack.callback(services.close)
        health = services.add(HealthService(config.health, events.emit))
        store, is_store_host = _connect(config, health.first, environ, interrupted)
        peer = services.add(PeerService(store, config.rendezvous.run_id, host, node))
        link, described = _MonitorLink(), {}  # `described`: the services' cycle-info fields
        context = ServiceContext(
            config=config, store=store, node=node, job_dir=job_dir, log_dir=log_dir,
            emit=events.emit, post=inbox.put, peer_server=peer.server, peer_client=peer.client,
            observe_timings=link.observe, read_events=events.subscribe, progress=link.progress,
            describe=described.__setitem__, gpus=link.gpus,
        )  # fmt: skip
        for factory in subsystems:
            services.add(factory(context))
        monitor, inprocess = _add_node_services(context, services, link)
        spawner = _spawner(config, environ, node, fork_server, services)
        runtime = AgentRuntime(
            config=config, environ=environ, host=host, node=node, node_log_dir=log_dir / node,
            events=events, inbox=inbox, store=store, is_store_host=is_store_host,
            infra_rank=infra_rank_from_env(environ, config.rendezvous.node_rank),
            services=services, monitor=monitor.server, spawner=spawner, job_dir=job_dir,
            inprocess=inprocess, peer_port=peer.server.port, restore_peer=peer.restore,
            answers=peer.answers,
        )  # fmt: skip
        services.add(CycleInfoService(job_dir, config.rendezvous.run_id, environ,
                                      runtime.control.cause_of, described))  # fmt: skip
        bound = datetime.timedelta(seconds=restart_watch.CONNECT_S)
        own_client = functools.partial(another_client, store, config.rendezvous.store, environ,
                                       bound)  # fmt: skip
        services.add(restart_watch.RestartWatch(own_client, runtime.control.restart_key,
                                                inbox.put))  # fmt: skip
        services.add(NeighbourWatch(peer.answers, inbox.put))
        yield runtime


class _MonitorLink:
    """The rank monitor and the health watch as the subsystems' services reach them: they start
    after them (the monitor's timings go to the observers they register), so they hold this
    link, not the services."""

    def __init__(self) -> None:
        self._observers: list[Callable[[TimingBatch], None]] = []
        self.monitor: MonitorService | None = None
        self.health: HealthWatch | None = None

    def gpus(self) -> tuple[GpuSnapshot, ...]:
        return self.health.gpus() if self.health else ()

    def observe(self, observer: Callable[[TimingBatch], None]) -> None:
        self._observers.append(observer)

    def progress(self) -> list[ProgressSnapshot]:
        return self.monitor.server.progress_snapshot() if self.monitor else []

    def on_timings(self) -> Callable[[TimingBatch], None] | None:
        """One callback for every observer; None when nobody observes (nothing to collect)."""
        if not self._observers:
            return None
        observers = list(self._observers)

        def each(batch: TimingBatch) -> None:
            for observer in observers:
                observer(batch)

        return each


JOB_DIR_PREFIX = "ftrun-job-"
_JOB_DIR = "job directory"
_STALE_AFTER_S = 60.0
"""A job directory younger than this is never taken for a dead launcher's (it may be starting)."""


def make_job_dir(parent: Path | None = None) -> tuple[Path, int | None]:
    """This launcher's 0700 IPC directory under the temporary directory, and the descriptor of
    the lock it holds on it while it lives (`ftrun.owned_dir`; keep it open). First, this
    user's job directories whose launcher is gone go: a launcher killed with SIGKILL cannot
    remove its own, and a node would gather one a lost launcher."""
    parent = parent or Path(tempfile.gettempdir())
    owned_dir.remove_abandoned(parent, JOB_DIR_PREFIX, _JOB_DIR, min_age_s=_STALE_AFTER_S)
    job_dir = Path(tempfile.mkdtemp(prefix=JOB_DIR_PREFIX, dir=parent))
    return job_dir, owned_dir.hold_owner_lock(job_dir, _JOB_DIR)


def _add_node_services(
    context: ServiceContext, services: NodeServices, link: _MonitorLink
) -> tuple[MonitorService, InprocessLink]:
    """The agent's own services that follow the subsystems': the rank monitor and the link to
    wrapped ranks (returned), the workers' store, the health watch and the GPU memory
    reclaim."""
    config, agent, emit, post = context.config, context.config.agent, context.emit, context.post
    services.add(WorkerStoreService())
    link.monitor = services.add(MonitorService(config.monitor, context.job_dir, post,
                                               link.on_timings()))  # fmt: skip
    if config.health.watch_interval > 0 and (config.health.gpu or config.health.nic):
        link.health = services.add(HealthWatch(config.health, emit, post))
    if agent.gpu_memory_reclaim_timeout > 0:
        services.add(GpuReclaimService(agent.gpu_memory_reclaim_timeout,
                                       agent.gpu_memory_tolerance_mb, emit,
                                       services.kept_pids))  # fmt: skip
    inprocess = InprocessLink(context.store, agent, config.rendezvous.run_id, emit)
    return link.monitor, services.add(inprocess)


def _spawner(
    config: LaunchConfig,
    environ: Mapping[str, str],
    node: str,
    fork_server: ForkServer | None,
    services: NodeServices,
) -> Spawner:
    """Forked from the node's fork server (a service: it lives as long as the node) where it
    can serve, else spawned plainly."""
    agent = config.agent
    plain = PlainSpawner(agent.entrypoint, plain_reason(config))
    server = fork_server or start_early(config, environ, node)
    target = python_target(agent.entrypoint)
    if server is None or target is None:
        return plain
    start_env = shared_env(config, environ, {}, None, node)
    return services.add(PrewarmService(server, target, agent.prewarm_deep_modules, start_env,
                                       plain, agent.prestart_workers))  # fmt: skip


def _open_events(log_dir: Path, node: str) -> EventLog:
    try:
        (log_dir / node).mkdir(parents=True, exist_ok=True)
        return EventLog(log_dir, node)
    except OSError as exc:
        raise log_dir_error(log_dir, exc) from None


def _connect(
    config: LaunchConfig,
    first_health: object,
    environ: Mapping[str, str],
    interrupted: Callable[[], bool],
) -> tuple[Store, bool]:
    """Meet the store; a node that starts unhealthy never hosts it (it is about to leave)."""
    unhealthy = first_health if isinstance(first_health, NodeUnhealthyError) else None
    try:
        return connect_store(config.rendezvous.store, unhealthy is None, environ, interrupted)
    except RendezvousFailedError as exc:
        if unhealthy is None:
            raise
        # Nobody to tell, but the cause that matters (and its exit code) is this node's health.
        raise NodeUnhealthyError(f"node unhealthy: {unhealthy} (and {exc})") from None
