"""The restart watch: a node learns that another node ended the cycle from a wait on the
cycle's restart key, not from polling it (a real TCPStore on 127.0.0.1, no agent)."""

from __future__ import annotations

import datetime
import queue
import threading
import time
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from ftrun.agent.node_services.restart_watch import CHUNK_S, CycleEndedElsewhere, RestartWatch
from ftrun.rendezvous.control import job_control
from support import free_port


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", free_port(), is_master=True,
                      timeout=datetime.timedelta(seconds=10))  # fmt: skip
    yield server


def client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False,
                    timeout=datetime.timedelta(seconds=10))  # fmt: skip


def test_the_restart_key_reaches_the_inbox_at_once_and_a_stopped_cycle_says_nothing(store):
    before = threading.active_count()
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    other = job_control(client(store), "job")
    watch = RestartWatch(lambda: client(store), other.restart_key, inbox.put)
    watch.on_started(SimpleNamespace(number=0), [])
    asked = time.monotonic()
    assert other.request_restart(0, "a crash elsewhere")
    assert inbox.get(timeout=CHUNK_S + 5) == CycleEndedElsewhere(0)
    assert time.monotonic() - asked < 0.5
    watch.on_started(SimpleNamespace(number=1), [])
    watch.on_stopped(None, [])  # this node restarts on its own: cycle 1's key means nothing
    other.request_restart(1, "too late")
    watch.close()
    assert inbox.empty()
    assert threading.active_count() == before


def test_on_etcd_one_watch_waits_half_a_minute_and_a_stop_ends_it_at_once(etcd_cluster):
    from ftrun.store.etcd_store import EtcdStore

    members = [("127.0.0.1", m.client_port) for m in etcd_cluster.members]
    made: list[EtcdStore] = []

    def connect() -> EtcdStore:
        made.append(EtcdStore(members, "job", datetime.timedelta(seconds=10)))
        return made[-1]

    before = threading.active_count()
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    other = job_control(connect(), "job")
    watch = RestartWatch(connect, other.restart_key, inbox.put)
    watch.on_started(SimpleNamespace(number=0), [])
    time.sleep(CHUNK_S * 1.5)  # past a short chunk: the same watch still answers at once
    asked = time.monotonic()
    assert other.request_restart(0, "a crash elsewhere")
    assert inbox.get(timeout=5) == CycleEndedElsewhere(0)
    assert time.monotonic() - asked < 0.5
    watch.on_started(SimpleNamespace(number=1), [])
    deadline = time.monotonic() + 10
    while len(made) < 3 and time.monotonic() < deadline:  # cycle 1's thread has its client
        time.sleep(0.01)
    stopped = time.monotonic()
    watch.on_stopped(None, [])
    watch.close()  # joins: within the interrupt, not the half-minute watch
    assert time.monotonic() - stopped < 1.0
    assert inbox.empty() and threading.active_count() == before
