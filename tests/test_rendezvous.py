"""Rendezvous behaviour on a real TCPStore, agents as threads: shared by both implementations."""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import json
import re
from collections.abc import Iterator

import pytest
from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from ftrun.agent.decisions.state import AgentState, IllegalTransitionError, check_transition
from ftrun.config.rendezvous import RendezvousConfig, RendezvousImpl
from ftrun.errors import ExitCode, RendezvousFailedError
from ftrun.rendezvous.control import JobControl
from ftrun.rendezvous.errors import DESCRIPTOR_VERSION, DescriptorVersionError, InfraRankError
from ftrun.rendezvous.factory import create_rendezvous
from ftrun.rendezvous.ranks import NodeDescriptor, order_nodes, row_from_json

IMPLS = pytest.mark.parametrize("impl", list(RendezvousImpl))
_ids = itertools.count()


@pytest.fixture
def store() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    yield server


def client(server: TCPStore) -> TCPStore:
    return TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )


def node(name: str, infra: int | None = None) -> NodeDescriptor:
    return NodeDescriptor(node=name, host="127.0.0.1", local_world_size=2, master_port=1,
                          infra_rank=infra)  # fmt: skip


def join_all(server, impl, nodes, run_id=None, **conf):
    config = RendezvousConfig(
        endpoint=f"127.0.0.1:{server.port}",
        run_id=run_id or f"run{next(_ids)}",
        min_nodes=conf.pop("min_nodes", len(nodes)),
        max_nodes=conf.pop("max_nodes", len(nodes)),
        impl=impl,
        join_timeout=conf.pop("join_timeout", 30),
        **conf,
    )
    handlers = [create_rendezvous(config, client(server), lambda d=d: d) for d in nodes]
    with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
        rounds = list(pool.map(lambda h: h.join(lambda: False), handlers))
    return rounds, handlers


@IMPLS
def test_every_node_sees_the_same_round(store, impl):
    rounds, _ = join_all(store, impl, [node("a"), node("b"), node("c")])
    assert len({r.nodes for r in rounds}) == 1
    assert sorted(r.group_rank for r in rounds) == [0, 1, 2]
    assert all(r.world_size == 6 and r.number == 0 for r in rounds)
    assert [r.first_global_rank for r in sorted(rounds, key=lambda r: r.group_rank)] == [0, 2, 4]


@IMPLS
def test_infra_group_rank_orders_nodes(store, impl):
    rounds, _ = join_all(
        store, impl, [node("x", 2), node("y", 0), node("z", 1)], use_infra_group_rank=True
    )
    assert {r.me.node: r.group_rank for r in rounds} == {"y": 0, "z": 1, "x": 2}


@IMPLS
def test_too_many_unhealthy_nodes_end_the_wait_with_a_clear_error(store, impl):
    run_id = f"sick{next(_ids)}"
    JobControl(client(store), f"ftrun/{run_id}").report_unhealthy(0, "bad", "GPU 0: ECC")
    with pytest.raises(RendezvousFailedError, match="at most 1 healthy node"):
        join_all(store, impl, [node("a")], run_id=run_id, max_nodes=2, min_nodes=2)


def test_barrier_last_call_closes_a_partial_round(store):
    rounds, _ = join_all(
        store, RendezvousImpl.BARRIER, [node("a"), node("b")],
        min_nodes=2, max_nodes=3, last_call_timeout=0.2,
    )  # fmt: skip
    assert {len(r.nodes) for r in rounds} == {2}


def test_barrier_late_node_waits_and_joins_the_next_cycle(store):
    _, handlers = join_all(
        store, RendezvousImpl.BARRIER, [node("a"), node("b")],
        min_nodes=2, max_nodes=3, last_call_timeout=0.2,
    )  # fmt: skip
    control = handlers[0].control
    late = create_rendezvous(handlers[0]._config, client(store), lambda: node("late"))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        pending = pool.submit(late.join, lambda: False)
        assert not concurrent.futures.wait([pending], timeout=0.5).done  # round 0 is full
        assert handlers[0].num_nodes_waiting() == 1
        assert control.request_restart(0, "scale up", failure=False)
        again = [pool.submit(h.join, lambda: False) for h in handlers]
        joined = [f.result(timeout=30) for f in (pending, *again)]
    assert {r.number for r in joined} == {1} and {len(r.nodes) for r in joined} == {3}
    assert control.failures() == 0


def test_shutdown_closes_the_rendezvous_for_everyone(store):
    _, handlers = join_all(store, RendezvousImpl.BARRIER, [node("a")])
    handlers[0].control.shutdown(ExitCode.PREEMPTED, "SIGTERM on node a", 0)
    with pytest.raises(RendezvousClosedError, match="SIGTERM on node a"):
        handlers[0].join(lambda: False)


def test_simultaneous_failures_make_one_restart_and_one_failure(store):
    controls = [JobControl(client(store), "ftrun/votes") for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        winners = list(pool.map(lambda c: c.request_restart(0, "crash"), controls))
    assert winners.count(True) == 1
    assert (controls[0].cycle(), controls[0].failures()) == (1, 1)
    assert controls[3].restart_requested(0) and not controls[3].restart_requested(1)


class Resending(Store):
    """A client that lost the answer to every write and sent it again: each `add` and
    `compare_set` reaches the store twice (etcd's client does so when a member stops answering
    after it applied a request)."""

    def __init__(self, inner: TCPStore) -> None:
        super().__init__()
        self._inner = inner

    def add(self, key: str, amount: int) -> int:
        self._inner.add(key, amount)
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._inner.compare_set(key, expected, desired)
        return self._inner.compare_set(key, expected, desired)

    def set(self, key: str, value: str) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)


def test_a_vote_sent_twice_still_has_one_winner(store):
    controls = [JobControl(Resending(client(store)), "ftrun/resent") for _ in range(2)]
    assert [c.request_restart(0, "crash") for c in controls] == [True, False]
    assert controls[1].cycle() == 1 and controls[1].restart_requested(0)


@pytest.mark.parametrize(
    ("nodes", "error"),
    [
        ([node("a", 0), node("b")], "node.s. b have no infra rank"),
        ([node("a", 1), node("b", 1)], "nodes a and b both have infra rank 1"),
    ],
)
def test_missing_or_duplicate_infra_rank_is_a_usage_error(nodes, error):
    with pytest.raises(InfraRankError, match=error) as caught:
        order_nodes(nodes, use_infra_group_rank=True)
    assert caught.value.exit_code is ExitCode.USAGE


def test_agent_lifecycle_refuses_illegal_moves():
    assert check_transition(AgentState.RUNNING, AgentState.STOPPING) is AgentState.STOPPING
    with pytest.raises(IllegalTransitionError, match="from running to rendezvous"):
        check_transition(AgentState.RUNNING, AgentState.RENDEZVOUS)


def test_torch_finds_the_barrier_backend_by_name(store):
    """The `torchrun.handlers` entry point puts `ftrun-barrier` in torch's registry."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        backend="ftrun-barrier",
        endpoint=f"127.0.0.1:{store.port}",
        run_id=f"run{next(_ids)}",
        min_nodes=1,
        max_nodes=1,
        join_timeout=30,
    )
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    assert (handler.get_backend(), info.rank, info.world_size) == ("ftrun-barrier", 0, 1)


def test_descriptor_round_trips_with_its_peer_port():
    mine = NodeDescriptor("a", "10.0.0.1", 8, 29500, infra_rank=3, peer_port=41234)
    assert NodeDescriptor.from_json(mine.to_json()) == mine
    assert json.loads(mine.to_json())["version"] == DESCRIPTOR_VERSION
    assert row_from_json(mine.to_json()) == mine.to_row()
    assert NodeDescriptor.from_row(mine.to_row()) == mine
    rows = json.loads(json.dumps([mine.to_row(), node("b").to_row()]))  # as published
    assert NodeDescriptor.from_rows(rows) == [mine, node("b")]
    assert node("b").peer_port == 0  # no channel


NEWER = DESCRIPTOR_VERSION + 1
V1_JSON = (
    b'{"node": "old", "host": "h", "local_world_size": 8, "master_port": 1, "infra_rank": null}'
)


@pytest.mark.parametrize(
    ("raw", "version"),
    [
        (V1_JSON, 1),
        (
            json.dumps({**node("old")._asdict(), "version": NEWER, "rdma": "mlx5_0"}).encode(),
            NEWER,
        ),
        (b"\x92\xa3old", "unknown"),  # not JSON: a release with another encoding
    ],
    ids=["older", "newer", "other-encoding"],
)
def test_a_descriptor_of_another_version_is_refused_clearly(raw, version):
    who = "old" if version != "unknown" else "?"
    expected = re.escape(f"node {who} publishes node descriptor version {version}, this ftrun")
    with pytest.raises(DescriptorVersionError, match=expected) as caught:
        NodeDescriptor.from_json(raw)
    assert caught.value.exit_code is ExitCode.USAGE and "\n" not in str(caught.value)
    # The closer of a barrier round publishes it as a stub that every participant refuses.
    with pytest.raises(DescriptorVersionError, match=expected):
        NodeDescriptor.from_rows([node("a").to_row(), row_from_json(raw)])


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (["old", "h", 8, 1, None], "node old publishes node descriptor version 1"),
        (
            [NEWER, "new", "h", 8, 1, None, 5, "extra"],
            f"node new publishes node descriptor version {NEWER}",
        ),
        (
            [DESCRIPTOR_VERSION, "short", "h", 8],
            f"node short publishes node descriptor version {DESCRIPTOR_VERSION} with 3 fields, "
            "not 6",
        ),
    ],
    ids=["older", "newer", "malformed"],
)
def test_a_published_row_of_another_version_is_refused_clearly(row, expected):
    with pytest.raises(DescriptorVersionError, match=expected):
        NodeDescriptor.from_rows([node("a").to_row(), row])


class OlderDescriptor(NodeDescriptor):
    """What a node running the release before descriptor versions writes to the store."""

    def to_json(self) -> bytes:
        return V1_JSON


@IMPLS
def test_a_node_of_another_descriptor_version_fails_every_node_of_the_round(store, impl):
    nodes = [node("a"), node("b"), OlderDescriptor("old", "h", 8, 1)]
    config = RendezvousConfig(
        endpoint=f"127.0.0.1:{store.port}", run_id=f"mixed{next(_ids)}", min_nodes=3,
        max_nodes=3, impl=impl, join_timeout=30,
    )  # fmt: skip
    handlers = [create_rendezvous(config, client(store), lambda d=d: d) for d in nodes]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        joins = [pool.submit(h.join, lambda: False) for h in handlers]
        errors = [f.exception(timeout=30) for f in joins]
    assert all(isinstance(e, DescriptorVersionError) for e in errors), errors
    assert {str(e) for e in errors} == {
        f"node old publishes node descriptor version 1, this ftrun reads version "
        f"{DESCRIPTOR_VERSION}: run the same ftrun release on every node of the job"
    }


def test_a_node_gone_between_arrival_and_descriptor_does_not_hold_the_round(store):
    """A ghost arrives first (it would be the round's planner) and never writes its descriptor:
    the other two close the round without it within the descriptor grace and the planner
    takeover, far inside the join timeout (not the store's timeout)."""
    config = RendezvousConfig(
        endpoint=f"127.0.0.1:{store.port}", run_id=f"run{next(_ids)}", min_nodes=2,
        max_nodes=2, join_timeout=25,
    )  # fmt: skip
    handlers = [
        create_rendezvous(config, client(store), lambda d=d: d) for d in (node("a"), node("b"))
    ]
    ghost = client(store)
    ghost.add(f"ftrun/{config.run_id}/c0/arrivals", 1)  # arrived, then died
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rounds = list(pool.map(lambda h: h.join(lambda: False), handlers))
    assert {tuple(n.node for n in r.nodes) for r in rounds} in ({("a", "b")}, {("b", "a")})
