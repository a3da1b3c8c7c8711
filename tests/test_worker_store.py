"""The workers' store that the round's first agent hosts (agent/node_services/worker_store.py):
a real TCPStore on 127.0.0.1, no worker processes."""

from __future__ import annotations

import datetime
import socket

import pytest
from torch.distributed import TCPStore

from ftrun.agent.node_services.worker_store import WorkerStoreService
from ftrun.agent.worker_env import AGENT_STORE_ENV
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from support import free_port


def round_of(number: int, group_rank: int, port: int) -> Round:
    nodes = (NodeDescriptor("n0", "127.0.0.1", 2, port), NodeDescriptor("n1", "127.0.0.1", 2, 1))
    return Round(number, nodes, group_rank)


def client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False,
                    timeout=datetime.timedelta(seconds=5))  # fmt: skip


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_the_first_node_hosts_a_fresh_store_each_cycle() -> None:
    service = WorkerStoreService()
    port = free_port()
    first = round_of(0, 0, port)
    service.on_round(first)
    assert service.worker_env(first) == {AGENT_STORE_ENV: "True"}
    client(port).set("rank0-was-here", "1")
    service.on_stopped(first, [])
    assert not listening(port)
    again = round_of(1, 0, port)
    service.on_round(again)
    assert not client(port).check(["rank0-was-here"])  # nothing of the cycle before
    service.close()
    assert not listening(port)


def test_other_nodes_host_nothing() -> None:
    service = WorkerStoreService()
    port = free_port()
    service.on_round(round_of(0, 1, port))
    assert service.worker_env(round_of(0, 1, port)) == {AGENT_STORE_ENV: "False"}
    assert not listening(port)


def test_a_taken_port_leaves_the_store_to_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = WorkerStoreService()
        with caplog.at_level("WARNING", logger="ftrun.agent"):
            service.on_round(round_of(0, 0, port))
        assert service.worker_env(round_of(0, 0, port)) == {AGENT_STORE_ENV: "False"}
        assert "rank 0 hosts it" in caplog.text
