"""The peer channel as the agents run it: one service per node, bound to its job by the store."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

from ftrun.agent.node_services.peering import PeerService
from ftrun.peer import PeerHandshakeError


@pytest.fixture
def store() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield server


def client_of(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False,
                    timeout=datetime.timedelta(seconds=10))  # fmt: skip


def test_nodes_of_one_job_reach_each_other(store: TCPStore) -> None:
    threads_before = set(threading.enumerate())
    a = PeerService(store, "job-1", "127.0.0.1", "node-a")
    b = PeerService(client_of(store), "job-1", "127.0.0.1", "node-b")
    try:
        assert a.server.port != b.server.port and a.server.port > 0
        reply, bulk = a.client.request("127.0.0.1", b.server.port, "node", timeout=10)
        assert (reply, bulk) == ({"node": "node-b"}, None)
        reply, _ = b.client.request("127.0.0.1", a.server.port, "node", timeout=10)
        assert reply == {"node": "node-a"}
    finally:
        a.close()
        b.close()
    assert set(threading.enumerate()) <= threads_before


def test_another_job_is_turned_away(store: TCPStore) -> None:
    """Same store, other run id: another secret, and the handshake fails both ways."""
    ours = PeerService(store, "job-1", "127.0.0.1", "node-a")
    theirs = PeerService(client_of(store), "job-2", "127.0.0.1", "node-x")
    try:
        with pytest.raises(PeerHandshakeError):
            theirs.client.request("127.0.0.1", ours.server.port, "node", timeout=10)
        with pytest.raises(PeerHandshakeError):
            ours.client.request("127.0.0.1", theirs.server.port, "node", timeout=10)
    finally:
        ours.close()
        theirs.close()
