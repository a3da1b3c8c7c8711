"""The barrier round at scale, counted: O(1) store writes per node, and one Round for all.

Agents are threads, each with its own TCPStore client connection to one real TCPStore on
127.0.0.1 and its own BarrierRendezvousHandler (as in bench/rendezvous/rendezvous_scale.py,
which times the same round at 1024 nodes; here only counts and outcomes are asserted, never
times). Each client is wrapped in a `CountingStore` that records every operation the handler
makes with its key."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from ftrun.config.rendezvous import RendezvousConfig
from ftrun.rendezvous.barrier import BarrierRendezvousHandler
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from support import wait_for

HOST = "127.0.0.1"
STORE_TIMEOUT = datetime.timedelta(seconds=30)
JOIN_TIMEOUT_S = 30.0
DEADLINE_S = JOIN_TIMEOUT_S + 15  # every agent thread is joined within this, or the test fails
WRITES = ("set", "add", "compare_set", "multi_set")
_ids = itertools.count()


class CountingStore(dist.Store):
    """Forwards to one TCPStore client and logs (op, key) of every call.

    `add(key, 0)` only reads a counter; it is logged as "add0" and not counted as a write.
    """

    def __init__(self, inner: dist.TCPStore) -> None:
        super().__init__()
        self._inner = inner
        self.log: list[tuple[str, str]] = []

    def _call(self, op: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.log.append((op, key))
        return fn(*args)

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, self._inner.set, key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._inner.get, key)

    def add(self, key: str, value: int) -> int:
        return self._call("add" if value else "add0", key, self._inner.add, key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, self._inner.compare_set, key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", ",".join(keys), self._inner.check, keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        args = (keys,) if timeout is None else (keys, timeout)
        self._call("wait", ",".join(keys), self._inner.wait, *args)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", ",".join(keys), self._inner.multi_get, keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", ",".join(keys), self._inner.multi_set, keys, values)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key, self._inner.delete_key, key)

    def num_keys(self) -> int:
        return self._call("num_keys", "", self._inner.num_keys)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def writes(self) -> Counter[str]:
        return Counter(op for op, _ in self.log if op in WRITES)


def descriptor(index: int, infra_rank: int | None = None) -> NodeDescriptor:
    """Node `index`'s descriptor; fields NodeDescriptor does not (yet) have are left out, and
    fields added since keep their defaults."""
    values: dict[str, Any] = {
        "node": f"node{index:03d}",
        "host": f"10.0.{index // 256}.{index % 256}",
        "local_world_size": 2 + index % 3,  # unequal, so rank ranges show the order
        "master_port": 29500,
        "infra_rank": infra_rank,
    }
    return NodeDescriptor(**{k: v for k, v in values.items() if k in NodeDescriptor._fields})


@dataclasses.dataclass
class Agent:
    me: NodeDescriptor
    store: CountingStore
    handler: BarrierRendezvousHandler | None = None
    round: Round | None = None
    error: BaseException | None = None
    joined_at: int = 0
    """Where the join's operations start in `store.log` (construction writes come before)."""

    def join_log(self) -> list[tuple[str, str]]:
        return self.store.log[self.joined_at :]

    def join_writes(self) -> Counter[str]:
        return Counter(op for op, _ in self.join_log() if op in WRITES)


@pytest.fixture(scope="module")
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore(
        HOST, 0, is_master=True, multi_tenant=True, use_libuv=True, wait_for_workers=False
    )
    yield store


def run_round(
    server: dist.TCPStore, descriptors: list[NodeDescriptor], use_infra_group_rank: bool = False
) -> list[Agent]:
    """Every agent joins one round of `len(descriptors)` nodes at a common start."""
    nodes = len(descriptors)
    config = RendezvousConfig(
        endpoint=f"{HOST}:{server.port}",
        run_id=f"count{next(_ids)}",
        min_nodes=nodes,
        max_nodes=nodes,
        join_timeout=JOIN_TIMEOUT_S,
        use_infra_group_rank=use_infra_group_rank,
        local_addr=HOST,
    )
    agents = [
        Agent(d, CountingStore(dist.TCPStore(HOST, server.port, timeout=STORE_TIMEOUT)))
        for d in descriptors
    ]
    start = threading.Barrier(nodes, timeout=DEADLINE_S)
    stop = threading.Event()

    def main(agent: Agent) -> None:
        try:
            agent.handler = BarrierRendezvousHandler(config, agent.store, lambda: agent.me)
            agent.joined_at = len(agent.store.log)
            start.wait()
            agent.round = agent.handler.join(stop.is_set)
        except BaseException as exc:
            agent.error = exc
            start.abort()

    threads = [threading.Thread(target=main, args=(a,), daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: not any(t.is_alive() for t in threads), DEADLINE_S, "every agent's Round")
    finally:
        stop.set()  # agents still waiting leave through `interrupted` within a second
        for thread in threads:
            thread.join(5)
    errors = [f"{a.me.node}: {a.error!r}" for a in agents if a.error is not None]
    assert not errors, errors
    return agents


def assert_one_round(agents: list[Agent]) -> Round:
    """Every agent holds the same Round: same number and node order, each agent at a distinct
    group rank where the Round puts its own descriptor, consistent world size and rank ranges."""
    rounds = [a.round for a in agents]
    assert all(r is not None for r in rounds)
    first = rounds[0]
    assert first is not None
    assert {(r.number, r.nodes) for r in rounds if r is not None} == {(0, first.nodes)}
    assert sorted(first.nodes) == sorted(a.me for a in agents)
    assert sorted(r.group_rank for r in rounds if r is not None) == list(range(len(agents)))
    for agent in agents:
        assert agent.round is not None and agent.round.me == agent.me, agent.me.node
    world = sum(a.me.local_world_size for a in agents)
    assert {r.world_size for r in rounds if r is not None} == {world}
    starts = sorted(r.first_global_rank for r in rounds if r is not None)
    ends = sorted(r.first_global_rank + r.me.local_world_size for r in rounds if r is not None)
    assert starts == [0, *ends[:-1]] and ends[-1] == world  # ranges tile 0..world-1
    return first


def write_profile(agents: list[Agent]) -> dict[str, Any]:
    """What one round costs each node in store writes, and how it reads the descriptors."""
    closers = [a for a in agents if a.join_writes()["compare_set"]]
    return {
        "writes per node": sorted({sum(a.join_writes().values()) for a in agents}),
        "writes of a node that does not close": sorted(
            {tuple(sorted(a.join_writes().items())) for a in agents if a not in closers}
        ),
        "construction writes per node": sorted(
            {sum(1 for op, _ in a.store.log[: a.joined_at] if op in WRITES) for a in agents}
        ),
        "closers read the descriptors in one multi_get": all(
            [op for op, _ in a.join_log()].count("multi_get") == 1 for a in closers
        ),
        "single-descriptor reads": sum(
            1 for a in agents for op, key in a.join_log() if op == "get" and "/node/" in key
        ),
        "others never read the descriptors": not [
            a for a in agents if a not in closers and "multi_get" in {op for op, _ in a.join_log()}
        ],
        "round blob reads per node": sorted(
            {
                sum(1 for op, key in a.join_log() if op == "get" and key.endswith("/closed"))
                for a in agents
            }
        ),
    }


def test_store_writes_per_node_do_not_grow_with_the_number_of_nodes(server):
    """A node arrives (add) and writes its descriptor (set); the node that fills the round also
    closes it with the round as the value (compare_set): 2 or 3 writes, at 8 nodes as at 64. The
    descriptors are read in one multi_get by the closer and as one blob by everyone."""
    profiles = {}
    for nodes in (8, 64):
        agents = run_round(server, [descriptor(i) for i in range(nodes)])
        assert_one_round(agents)
        profiles[nodes] = write_profile(agents)
    expected = {
        "writes per node": [2, 3],
        "writes of a node that does not close": [(("add", 1), ("set", 1))],
        "construction writes per node": [1],  # the cycle key's compare_set
        "closers read the descriptors in one multi_get": True,
        "single-descriptor reads": 0,
        "others never read the descriptors": True,
        "round blob reads per node": [1],
    }
    assert profiles == {8: expected, 64: expected}


def test_every_agent_gets_the_same_round_in_infra_rank_order(server):
    """With --ft-use-infra-group-rank the order is the infra ranks', whatever the arrival order."""
    if "infra_rank" not in NodeDescriptor._fields:
        pytest.fail("NodeDescriptor lost infra_rank: update descriptor() in this test")
    infra = list(range(32))
    random.Random(12).shuffle(infra)
    agents = run_round(server, [descriptor(i, infra[i]) for i in range(32)], True)
    first = assert_one_round(agents)
    assert [d.infra_rank for d in first.nodes] == list(range(32))
    assert {a.me.node: a.round.group_rank for a in agents if a.round} == {
        descriptor(i).node: infra[i] for i in range(32)
    }


class WatchingStore(CountingStore):
    """A store whose waits are requests of their own, as etcd's watches: it has `get_within`,
    and logs each one's timeout."""

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = (timeout or STORE_TIMEOUT).total_seconds()
        self._call("wait", f"{seconds:g}", self._inner.wait, keys, timeout or STORE_TIMEOUT)

    def get_within(self, key: str, timeout_s: float) -> bytes | None:
        self.log.append(("get_within", f"{timeout_s:g}"))
        try:
            self._inner.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            return None
        return self._inner.get(key)


def test_on_a_store_whose_waits_are_requests_a_waiting_node_waits_once_a_look(server):
    """The planner (the first arrival) waits 1 s at a time and looks each time; a node that
    does not plan looks every 3 s, so on etcd it waits 3 s in one watch, not three; so does a
    node standing by through the cycle."""
    config = RendezvousConfig(endpoint=f"{HOST}:{server.port}", run_id=f"watch{next(_ids)}",
                              min_nodes=3, max_nodes=3, join_timeout=JOIN_TIMEOUT_S,
                              local_addr=HOST)  # fmt: skip
    agents = [Agent(descriptor(i), WatchingStore(dist.TCPStore(HOST, server.port,
                                                               timeout=STORE_TIMEOUT)))
              for i in range(4)]  # fmt: skip
    stop = threading.Event()

    def main(agent: Agent) -> None:
        try:
            agent.handler = BarrierRendezvousHandler(config, agent.store, lambda: agent.me)
            agent.round = agent.handler.join(stop.is_set)
        except BaseException as exc:
            agent.error = exc

    def waits(agent: Agent) -> list[str]:
        return [timeout for op, timeout in list(agent.store.log) if op == "get_within"]

    def standby_waits() -> list[str]:
        return [timeout for op, timeout in list(agents[3].store.log) if op == "wait"]

    threads = [threading.Thread(target=main, args=(a,), daemon=True) for a in agents]
    try:
        threads[0].start()
        wait_for(lambda: waits(agents[0]), 10, "the planner waiting")
        threads[1].start()
        wait_for(lambda: waits(agents[1]), 10, "the other node waiting")
        threads[2].start()
        wait_for(lambda: not any(t.is_alive() for t in threads[:3]), DEADLINE_S, "every Round")
        threads[3].start()  # after the close: it stands by for the next cycle
        wait_for(standby_waits, 10, "the standby node waiting")
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
    assert_one_round(agents[:3])
    assert set(waits(agents[0])) == {"1"} and set(waits(agents[1])) == {"3"}
    assert set(standby_waits()) == {"3"} and agents[3].round is None
