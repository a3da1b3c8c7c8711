"""Suite-wide fixtures: every process a test starts must be gone when it ends (and, where a
module asks, `no_leftover_threads`, every thread); rank monitor servers and in-process clients
registered with them (rank monitor and workload control tests); `ftrun store` as a process of
the test's own (`store_process`: the store off the nodes)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from ftrun.client_lib import RankMonitorClient
from ftrun.rank_monitor import RankMonitorConfig, RankMonitorServer
from store_process import StoreProcess
from support import become_subreaper, live_descendants, reap_zombies, wait_for

become_subreaper()
# c10d reverse-resolves the address of every socket it connects or accepts; where the resolver
# drops queries (this VM), each drop stalls that connect by glibc's default 5 s. Set before any
# lookup in this process, and inherited by the launchers and workers the tests start (as
# bench/rendezvous/rendezvous_scale.py does for itself).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture
def store_process(tmp_path: Path) -> Iterator[StoreProcess]:
    """`ftrun store` for one test (tests/faults/conftest.py has its own, per matrix module)."""
    store = StoreProcess(tmp_path / "store.log")
    yield store
    store.stop()
    assert store.proc.poll() is not None


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = {p.pid for p in live_descendants()}
    yield
    reap_zombies()

    def leftovers() -> list[psutil.Process]:
        reap_zombies()
        return [p for p in live_descendants() if p.pid not in before]

    try:
        wait_for(lambda: not leftovers(), timeout=10, what="test processes to exit")
    except AssertionError:
        stray = leftovers()
        names = [f"{p.pid}:{' '.join(p.cmdline())[:80]}" for p in stray]
        for proc in stray:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        reap_zombies()
        pytest.fail(f"processes left behind: {names}")


@pytest.fixture
def no_leftover_threads() -> Iterator[None]:
    """Every thread the test started has ended (bounded wait) when it ends."""
    before = set(threading.enumerate())
    yield
    wait_for(
        lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()],
        timeout=10,
        what="the threads the test started to exit",
    )


@pytest.fixture
def in_process_client(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A client in this process, registered as `rank` with `server`."""
    clients: list[RankMonitorClient] = []

    def connect(server: RankMonitorServer, rank: int) -> RankMonitorClient:
        for key, value in {**server.worker_env(), "RANK": str(rank)}.items():
            monkeypatch.setenv(key, value)
        server.expect_rank(rank, os.getpid())
        client = RankMonitorClient()
        client.init_workload_monitoring()
        clients.append(client)
        return client

    yield connect
    for client in clients:
        client.shutdown_workload_monitoring()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator:
    """Started RankMonitorServers (heartbeat timeouts 60 s unless given), stopped at the end."""
    servers: list[RankMonitorServer] = []

    def make(
        on_progress: Callable | None = None,
        on_control: Callable | None = None,
        **timeouts: object,
    ) -> RankMonitorServer:
        config = RankMonitorConfig(
            **{"initial_rank_heartbeat_timeout": 60.0, "rank_heartbeat_timeout": 60.0, **timeouts}
        )
        job_dir = tmp_path / f"job{len(servers)}"
        server = RankMonitorServer(
            config, job_dir=job_dir, on_progress=on_progress, on_control=on_control
        ).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """tests/fakes/pynvml.py imported as `pynvml`; the test describes the GPUs in FAKE_NVML."""
    spec = importlib.util.spec_from_file_location(
        "pynvml", Path(__file__).parent / "fakes" / "pynvml.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return monkeypatch


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator:
    """A 3-member etcd cluster on 127.0.0.1 (tests/etcd_cluster.py), stopped at the end."""
    from etcd_cluster import EtcdCluster

    cluster = EtcdCluster(tmp_path)
    try:
        cluster.bootstrap()
        yield cluster
    finally:
        cluster.stop()
