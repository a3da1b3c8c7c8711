"""The neighbour watch: each node probes the next node of its round on the peer channel and
tells its agent when that node stops answering (fake probes, then real peer channels on
127.0.0.1; no agent)."""

from __future__ import annotations

import datetime
import queue
import threading
import time

import pytest
from torch.distributed import TCPStore

from ftrun.agent.node_services.neighbour_watch import (
    MISSES_IN_A_ROW,
    NeighbourLost,
    NeighbourWatch,
)
from ftrun.agent.node_services.peering import PeerService
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from support import wait_for

FAST_S = 0.02


def node(name: str, peer_port: int = 1000) -> NodeDescriptor:
    return NodeDescriptor(name, "127.0.0.1", 1, 29500, peer_port=peer_port)


def round_of(*nodes: NodeDescriptor, me: int = 0, number: int = 0) -> Round:
    return Round(number, tuple(nodes), me)


def test_each_node_watches_the_next_by_group_rank_and_the_last_the_first():
    a, b, c = node("a"), node("b"), node("c")
    assert NeighbourWatch.neighbour(round_of(a, b, c, me=0)) == b
    assert NeighbourWatch.neighbour(round_of(a, b, c, me=2)) == a
    assert NeighbourWatch.neighbour(round_of(a)) is None  # alone: nothing to watch
    assert NeighbourWatch.neighbour(round_of(a, node("b", peer_port=0))) is None


def test_a_neighbour_that_misses_probes_in_a_row_is_lost_once_and_one_answer_resets():
    replies = iter([False, False, True, *([False] * MISSES_IN_A_ROW), True, True])
    probes: list[str] = []

    def answers(descriptor: NodeDescriptor) -> bool:
        probes.append(descriptor.node)
        return next(replies, True)

    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    before = threading.active_count()
    watch = NeighbourWatch(answers, inbox.put, interval_s=FAST_S)
    watch.on_started(round_of(node("a"), node("b"), number=3), [])
    assert inbox.get(timeout=5) == NeighbourLost(3, "b")
    assert len(probes) == 3 + MISSES_IN_A_ROW  # the watch ends with the loss: no more probes
    watch.close()
    assert inbox.empty() and threading.active_count() == before


def test_a_stopped_or_finished_cycle_says_nothing():
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    before = threading.active_count()
    watch = NeighbourWatch(lambda _: False, inbox.put, interval_s=0.5)
    watch.on_started(round_of(node("a"), node("b")), [])
    watch.on_stopped(None, [])
    watch.on_started(round_of(node("a"), node("b"), number=1), [])
    watch.on_finished(round_of(node("a"), node("b"), number=1))
    watch.close()
    assert inbox.empty() and threading.active_count() == before


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=10))  # fmt: skip


def test_an_agent_whose_channel_closes_is_lost_within_its_misses(store):
    here = PeerService(store, "job", "127.0.0.1", "here")
    there = PeerService(store, "job", "127.0.0.1", "there")
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    answered: list[bool] = []

    def answers(descriptor: NodeDescriptor) -> bool:
        answered.append(here.answers(descriptor))
        return answered[-1]

    watch = NeighbourWatch(answers, inbox.put, interval_s=FAST_S)
    rnd = round_of(node("here", here.server.port), node("there", there.server.port))
    try:
        watch.on_started(rnd, [])
        wait_for(lambda: len(answered) >= 2 * MISSES_IN_A_ROW, 10, "probes of a live neighbour")
        assert all(answered) and inbox.empty()
        there.close()
        closed = time.monotonic()
        assert inbox.get(timeout=5) == NeighbourLost(0, "there")
        assert time.monotonic() - closed < 2.0  # a closed port refuses at once
    finally:
        watch.close()
        here.close()
        there.close()
