"""Coming through a restart of the store (`store.reconnecting`, `JobControl.restore`), with
no process: stores are HashStores behind a client the test breaks, as a killed `ftrun store`
breaks the agents' connections (tests/test_store_restart.py does it with processes)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.distributed import DistNetworkError, HashStore, Store

from agent_harness import running_agent
from ftrun.agent.decisions.observed import Facts, StoreRestarted
from ftrun.agent.decisions.policy import KEEP_WATCHING, Action, Policy
from ftrun.agent.decisions.state import AgentState
from ftrun.errors import ExitCode
from ftrun.rendezvous.control import FailureRecord, Shutdown, job_control
from ftrun.store.connect import _await_listening
from ftrun.store.reconnecting import ReconnectingStore, StoreRestartedError
from launch import free_port
from support import wait_for


class Breakable(Store):
    """A client of `store` whose connection the test breaks (every call then fails as a
    TCPStore client's does when its server went away)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=2))
        self.store = store
        self.broken = False

    def _up(self) -> Store:
        if self.broken:
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        return self.store

    def set(self, key: str, value: str | bytes) -> None:
        self._up().set(key, value)

    def get(self, key: str) -> bytes:
        return self._up().get(key)

    def check(self, keys: list[str]) -> bool:
        return self._up().check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._up().add(key, amount)

    def append(self, key: str, value: str | bytes) -> None:
        self._up().append(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._up().compare_set(key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._up().multi_get(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._up().wait(keys)
        else:
            self._up().wait(keys, timeout)


class Server:
    """The store process: `restart` loses every key; `down` refuses connections."""

    def __init__(self) -> None:
        self.data: Store = HashStore()
        self.clients: list[Breakable] = []
        self.down = False

    def connect(self, _seconds: float = 0.0) -> Store:
        if self.down:
            raise TimeoutError("no store there")
        client = Breakable(self.data)
        self.clients.append(client)
        return client

    def restart(self) -> None:
        for client in self.clients:
            client.broken = True
        self.data = HashStore()

    def blink(self) -> None:
        """The network drops the connections; the store and its keys stay."""
        for client in self.clients:
            client.broken = True


def reconnecting(server: Server) -> ReconnectingStore:
    return ReconnectingStore(server.connect(), server.connect, 5.0, "127.0.0.1:1")


def test_a_blink_of_the_network_is_not_a_restart() -> None:
    server = Server()
    store = reconnecting(server)
    store.set("k", "v")
    server.blink()
    assert store.get("k") == b"v"  # made again on a new connection, nothing else happens


def test_a_restarted_store_refuses_calls_until_this_node_wrote_back_its_view() -> None:
    server = Server()
    store = reconnecting(server)
    store.set("k", "v")
    server.restart()
    with pytest.raises(StoreRestartedError) as raised:
        store.check(["k"])
    assert raised.value.store is store
    other: list[BaseException] = []  # another thread of the agent meanwhile
    thread = threading.Thread(target=lambda: _catch(other, lambda: store.get("k")))
    thread.start()
    thread.join(5)
    assert [type(e) for e in other] == [StoreRestartedError]
    store.rebuild(lambda: store.set("k", "again"))  # the rebuilding thread gets through
    assert store.get("k") == b"again"
    server.blink()  # the new epoch is this store's from now on
    assert store.get("k") == b"again"


def test_no_store_within_the_window_is_the_lost_connection() -> None:
    server = Server()
    store = reconnecting(server)
    server.restart()
    server.down = True
    with pytest.raises(DistNetworkError) as raised:
        store.get("k")
    assert not isinstance(raised.value, StoreRestartedError)
    server.down = False  # too late: the agent is leaving, its goodbyes must not wait again
    connects = len(server.clients)
    with pytest.raises(DistNetworkError):
        store.set("gone", "n0")
    assert len(server.clients) == connects


def test_a_signal_ends_the_wait_for_the_store_at_once() -> None:
    port = free_port()  # nothing listens there
    signalled = threading.Event()
    threading.Timer(0.2, signalled.set).start()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="signal"):
        _await_listening("127.0.0.1", port, started + 30, signalled.is_set)
    assert time.monotonic() - started < 5


def test_agents_write_back_one_fresh_cycle_their_failures_history_and_shutdown() -> None:
    old = HashStore()
    first, second = job_control(old, "job"), job_control(old, "job")
    assert first.request_restart(0, "crash")  # cycle 1, one failure
    first.record_failure(FailureRecord(0, "n0", "exception:ValueError"))
    assert second.cycle() == 1 and second.failures() == 1
    assert len(second.failure_history()) == 1
    new = HashStore()  # the store restarted; both agents reconnect to it
    first._store = second._store = new
    second.restore(1)  # the first to write back: a cycle after any it saw
    first.restore(0)
    assert first.cycle() == second.cycle() == 2
    assert first.failures() == 2  # the store's loss ended cycle 1: one failure, not one a node
    assert [r.node for r in first.failure_history()] == ["n0"]
    assert first.shutdown_requested() is None
    first.shutdown(ExitCode.PREEMPTED, "SIGTERM", 2)
    assert second.shutdown_requested() is not None  # seen before the next restart
    newer = HashStore()
    second._store = newer
    second.restore(2)
    assert second.shutdown_requested() == Shutdown(ExitCode.PREEMPTED, "SIGTERM")


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (AgentState.RUNNING, Action(AgentState.STOPPING)),
        (AgentState.STARTING, Action(AgentState.STOPPING)),
        (AgentState.RENDEZVOUS, KEEP_WATCHING),
        (AgentState.STOPPING, KEEP_WATCHING),
        (AgentState.SUCCEEDED, KEEP_WATCHING),
    ],
)
def test_the_policy_restarts_a_running_cycle_without_a_vote(
    state: AgentState, expected: Action
) -> None:
    facts = Facts(node="n0", cycle=3, round_size=2, max_nodes=2)
    assert Policy(max_restarts=3).decide(state, StoreRestarted(), facts) == expected


def test_the_agent_restarts_its_workers_in_the_cycle_the_store_was_given_back(tmp_path: Path):
    server = Server()
    store = reconnecting(server)
    with running_agent(tmp_path, ["--max-restarts=3"], store=store) as node:
        first = node.spawner.started(2)
        server.restart()
        second = node.spawner.started(4)[2:]
        assert all(w.returncode is not None for w in first)
        wait_for(lambda: len(node.events("rendezvous_done")) == 2, 10, "the second round")
        for worker in second:
            worker.exit(0)
        assert node.result() == ExitCode.SUCCESS
    assert [e["cycle"] for e in node.events("rendezvous_done")] == [0, 1]
    assert len(node.events("store_restarted")) == 1
    assert node.runtime.control.failures() == 1


def _catch(into: list[BaseException], call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException as exc:
        into.append(exc)
