"""What one agent holds for the life of a job: store, rendezvous, monitor, logs, identity.

Built once from the LaunchConfig by `open_runtime`, closed once at exit; the NodeAgent's states
use it and never build anything themselves.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrun.agent.events import EventLog
from ftrun.agent.gpu_memory import memory_baseline
from ftrun.agent.health import check_node
from ftrun.agent.spare_pool import SparePool, python_target
from ftrun.errors import ConfigError, NodeUnhealthyError, RendezvousFailedError
from ftrun.rank_monitor import RankMonitorServer
from ftrun.rendezvous.control import JobControl, wait_until
from ftrun.rendezvous.factory import NodeRendezvous, create_rendezvous
from ftrun.rendezvous.ranks import NodeDescriptor, Round, default_node_name, infra_rank_from_env
from ftrun.rendezvous.store import connect_store, is_local_host

if TYPE_CHECKING:
    from ftrun.config import LaunchConfig

log = logging.getLogger("ftrun.agent")


class AgentRuntime:
    """The agent's long-lived collaborators."""

    def __init__(self, config: LaunchConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        self.environ = dict(environ)
        rdzv = config.rendezvous
        self.host = _advertised_host(rdzv.endpoint, rdzv.local_addr)
        self.node = config.agent.node_name or default_node_name(environ, self.host)
        self.log_dir = config.agent.log_dir or Path(tempfile.mkdtemp(prefix="ftrun-logs-"))
        self.node_log_dir = self.log_dir / self.node
        try:
            self.node_log_dir.mkdir(parents=True, exist_ok=True)
            self.events = EventLog(self.log_dir, self.node)
        except OSError as exc:
            raise ConfigError(f"--log-dir {self.log_dir}: {exc.strerror or exc}") from None
        self.inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # A node that starts unhealthy must not host the store: it is about to leave.
        self._first_health = self._health_report()
        first = self._first_health
        unhealthy = first if isinstance(first, NodeUnhealthyError) else None
        try:
            self.store, self.is_store_host = connect_store(rdzv, may_host=unhealthy is None)
        except RendezvousFailedError as exc:
            if unhealthy is None:
                raise
            # Nobody to tell, but the cause that matters (and its exit code) is this node's health.
            raise NodeUnhealthyError(f"node unhealthy: {unhealthy} (and {exc})") from None
        self.infra_rank = infra_rank_from_env(environ, rdzv.node_rank)
        self.rendezvous: NodeRendezvous = create_rendezvous(rdzv, self.store, self.descriptor)
        self.control: JobControl = self.rendezvous.control
        target = python_target(config.agent.entrypoint)
        self.gpu_baseline = (
            memory_baseline() if config.agent.gpu_memory_reclaim_timeout > 0 else None
        )
        self.spares = (
            SparePool(target, config.agent.prewarm_modules, self.environ)
            if target is not None and config.agent.prewarm_modules
            else None
        )
        self.monitor = RankMonitorServer(
            config.monitor,
            job_dir=Path(tempfile.mkdtemp(prefix="ftrun-job-")),
            on_verdict=self.inbox.put,
        ).start()

    def descriptor(self) -> NodeDescriptor:
        return NodeDescriptor(
            node=self.node,
            host=self.host,
            local_world_size=self.config.agent.nproc_per_node,
            master_port=_free_port(self.host),
            infra_rank=self.infra_rank,
        )

    def check_health(self) -> None:
        """Raise NodeUnhealthyError if this node must not join; the first answer is cached."""
        result, self._first_health = self._first_health or self._health_report(), None
        if isinstance(result, NodeUnhealthyError):
            raise result
        self.events.emit("health_check", **result)

    def _health_report(self) -> dict[str, Any] | NodeUnhealthyError:
        started = time.monotonic()
        try:
            report = check_node(self.config.health)
        except NodeUnhealthyError as exc:
            return exc
        return {**report, "duration": round(time.monotonic() - started, 6)}

    def base_worker_env(self, rnd: Round) -> dict[str, str]:
        """Everything but the per-rank variables, as torchrun sets it, plus the monitor's."""
        agent, rdzv = self.config.agent, self.config.rendezvous
        env = {**self.environ, **agent.extra_env, **self.monitor.worker_env()}
        env.update(
            LOCAL_WORLD_SIZE=str(rnd.me.local_world_size),
            WORLD_SIZE=str(rnd.world_size),
            GROUP_RANK=str(rnd.group_rank),
            GROUP_WORLD_SIZE=str(len(rnd.nodes)),
            ROLE_NAME=agent.role,
            ROLE_WORLD_SIZE=str(rnd.world_size),
            MASTER_ADDR=rnd.master.host,
            MASTER_PORT=str(rnd.master.master_port),
            TORCHELASTIC_RESTART_COUNT=str(rnd.number),
            TORCHELASTIC_MAX_RESTARTS=str(agent.max_restarts),
            TORCHELASTIC_RUN_ID=rdzv.run_id,
            TORCHELASTIC_USE_AGENT_STORE="False",
            FTRUN_CYCLE=str(rnd.number),
            FTRUN_NODE=self.node,
        )
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if agent.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default against oversubscription
        return env

    def leave(self, rnd: Round | None, linger: float) -> None:
        """Say goodbye; the store host waits (bounded) until the round's other nodes did."""
        with contextlib.suppress(RuntimeError):
            if rnd is None:
                return
            self.control.arrive(rnd.number, "left")
            if self.is_store_host:
                wait_until(
                    lambda: self.control.count(rnd.number, "left") >= len(rnd.nodes),
                    linger,
                    0.05,
                )

    def close(self) -> None:
        if self.spares is not None:
            self.spares.close()
        self.monitor.stop()
        shutil.rmtree(self.monitor.job_dir, ignore_errors=True)
        self.events.close()


@contextlib.contextmanager
def open_runtime(config: LaunchConfig, environ: Mapping[str, str]) -> Iterator[AgentRuntime]:
    runtime = AgentRuntime(config, environ)
    try:
        yield runtime
    finally:
        runtime.close()


def _advertised_host(endpoint: str, local_addr: str | None) -> str:
    """The address other nodes use for this one: --local-addr, loopback in local runs, FQDN."""
    if local_addr:
        return local_addr
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(OSError, ValueError):
        resolved = socket.getaddrinfo(host, None)[0][4][0]
        if ipaddress.ip_address(resolved).is_loopback:
            return "127.0.0.1"
    if is_local_host(host):
        return host
    return socket.getfqdn()


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        return sock.getsockname()[1]
