"""The agent's checkpoint keeper: pure planning, then real keepers on 127.0.0.1 (a TCPStore, a
peer server and client per node, rounds built by hand, no worker processes)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from ftrun.agent.node_services.peering import PeerService
from ftrun.checkpointing.errors import CheckpointUsageError
from ftrun.checkpointing.keeper import KeeperService, KeeperSettings
from ftrun.checkpointing.keeper import holdings as plan
from ftrun.checkpointing.keeper.errors import PartRejectedError, RestoreError
from ftrun.checkpointing.keeper.holdings import Choice, Decision, Outcome
from ftrun.checkpointing.keeper.messages import (
    decode_decision,
    decode_holdings,
    decode_outcome,
    encode_decision,
    encode_holdings,
    encode_outcome,
    parse_part_request,
)
from ftrun.checkpointing.keeper.names import parse_iteration_dir, parse_part_name, valid_session
from ftrun.checkpointing.keeper.node_tier import NodeTier, remove_abandoned
from ftrun.checkpointing.keeper.transfer import PUSH, push_part
from ftrun.checkpointing.manager import LocalCheckpointManager
from ftrun.checkpointing.part_write import write_part
from ftrun.checkpointing.replication import CliqueReplicationStrategy
from ftrun.checkpointing.store import PartKey
from ftrun.checkpointing.tier_files import (
    POLICY_FILE,
    RESTORE_FILE,
    RestoreDecision,
    TierPolicy,
    read_json,
    write_json_atomically,
)
from ftrun.environment import Env
from ftrun.eventlog.schema import problems
from ftrun.owned_dir import OWNER_LOCK
from ftrun.peer import PeerRemoteError
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from support import wait_for

RUN = "job-k"
S = "sess"
FAST = KeeperSettings(
    poll_s=0.02, gather_s=3.0, fetch_s=5.0, transfer_base_s=3.0, max_part_bytes=1 << 20
)


def K(iteration: int, rank: int, world_size: int = 4) -> PartKey:
    return PartKey(iteration, rank, world_size)


# ---- pure planning ----------------------------------------------------------------------------


def test_choose_takes_the_newest_iteration_that_every_rank_has_somewhere() -> None:
    parts = {0: {K(5, 0), K(5, 1), K(3, 0), K(3, 1)}, 1: {K(3, 2), K(3, 3), K(5, 2)}}
    assert plan.choose(parts, 4) == Choice(3, 4)  # 5 lacks rank 3 everywhere
    parts[2] = {K(5, 3)}
    assert plan.choose(parts, 4) == Choice(5, 4)
    assert plan.choose(parts, 4, below=5) == Choice(3, 4)
    assert plan.choose({}, 4).iteration == -1
    assert plan.choose({0: {K(7, 0)}}, 4).iteration == -1


def test_choose_across_world_sizes() -> None:
    """Newest complete overall wins; another world size than the round's restores nothing;
    on a tie the round's world size wins."""
    two = {K(9, 0, 2), K(9, 1, 2)}
    four = {K(8, r) for r in range(4)}
    newest_elsewhere = plan.choose({0: two, 1: four}, 4)
    assert newest_elsewhere.iteration == -1 and "saved by 2 ranks" in newest_elsewhere.note
    assert plan.choose({0: two, 1: four}, 2) == Choice(9, 2)
    tie = {K(9, r) for r in range(4)}
    assert plan.choose({0: two, 1: tie}, 4) == Choice(9, 4)
    assert plan.choose({0: two, 1: tie}, 2) == Choice(9, 2)


def test_fetch_plan_and_the_first_decision() -> None:
    ranges = plan.node_ranges([2, 2])
    assert ranges == [range(0, 2), range(2, 4)]
    full = {S: {K(5, r): 100 for r in range(4)}}
    # Every node holds its own ranks: final at once, nothing to fetch.
    mine = {0: {S: {K(5, 0): 1, K(5, 1): 1}}, 1: {S: {K(5, 2): 1, K(5, 3): 1}}}
    assert plan.first_decision(mine, ranges) == Decision(0, True, {S: Choice(5, 4)}, (0, 1))
    # A replacement node (1) holds nothing: not final, it fetches ranks 2 and 3 from node 0.
    decision = plan.first_decision({0: full, 1: {}}, ranges)
    assert not decision.final and decision.choices[S] == Choice(5, 4)
    parts = plan.parts_by_node({0: full, 1: {}}, S)
    assert plan.fetch_plan(Choice(5, 4), parts, 1, ranges[1], ()) == [
        (K(5, 2), (0,)),
        (K(5, 3), (0,)),
    ]
    assert plan.fetch_plan(Choice(-1, 4), parts, 1, ranges[1], ()) == []
    assert plan.first_decision({}, ranges) == Decision(0, True, {}, ())


def test_next_decision_falls_back_without_the_failed_holders() -> None:
    ranges = plan.node_ranges([1, 1, 1])
    holdings = {
        0: {S: {K(5, 0, 3): 1, K(3, 0, 3): 1, K(3, 1, 3): 1, K(3, 2, 3): 1}},
        1: {},
        2: {S: {K(5, 1, 3): 1, K(5, 2, 3): 1}},
    }
    first = plan.first_decision(holdings, ranges)
    assert first.choices[S] == Choice(5, 3) and not first.final
    ok = Outcome()
    second = plan.next_decision(first, holdings, {0: ok, 1: Outcome({S: frozenset({2})}), 2: ok},
                                ranges, attempts=3)  # fmt: skip
    assert second.choices[S] == Choice(3, 3) and second.excluded == {2} and not second.final
    done = plan.next_decision(second, holdings, {0: ok, 1: ok, 2: ok}, ranges, attempts=3)
    assert done.final and done.choices[S] == Choice(3, 3) and done.attempt == 2
    # Out of attempts: restore nothing. A silent node: the whole job restores nothing.
    failed = {0: ok, 1: Outcome({S: frozenset({0})}), 2: ok}
    spent = plan.next_decision(second, holdings, failed, ranges, attempts=2)
    assert spent.final and spent.choices[S].iteration == -1
    silent = plan.next_decision(first, holdings, {0: ok, 1: None, 2: ok}, ranges, attempts=3)
    assert silent.final and silent.aborted and silent.choice(S, 3).iteration == -1


def test_push_targets_are_the_other_nodes_of_the_clique() -> None:
    ranges = plan.node_ranges([2, 2, 2, 2])
    assert plan.push_targets(0, 8, 2, 2, ranges, me=0) == [1]  # clique (0, 2)
    assert plan.push_targets(5, 8, 2, 2, ranges, me=2) == [3]  # clique (5, 7)
    assert plan.push_targets(0, 8, 1, 2, ranges, me=0) == []  # clique (0, 1): this node
    assert plan.push_targets(0, 8, 2, 4, ranges, me=0) == [1, 2, 3]
    with pytest.raises(CheckpointUsageError):
        plan.push_targets(0, 6, 2, 2, plan.node_ranges([2, 2, 2]), me=0)


def test_retention_rules() -> None:
    keys = [K(i, r) for i in (1, 2, 3) for r in (0, 1)] + [K(9, 0, 2)]
    assert plan.retention(keys, 2) == [K(1, 0), K(1, 1)]
    assert plan.retention(keys, 1) == [K(1, 0), K(2, 0), K(1, 1), K(2, 1)]
    # After restoring 2: 3 (rolled back) and the other world size go; retention on the rest.
    assert plan.after_restore(keys, Choice(2, 4), 2) == [K(3, 0), K(3, 1), K(9, 0, 2)]
    assert plan.after_restore(keys, Choice(2, 4), 1) == [
        *(K(1, 0), K(1, 1), K(3, 0), K(3, 1), K(9, 0, 2))
    ]
    assert plan.after_restore(keys, Choice(-1, 4), 2) == sorted(keys)
    # The protected iteration stays whatever its age, at its world size only.
    assert plan.retention(keys, 1, protected=(1, 4)) == [K(2, 0), K(2, 1)]
    assert plan.retention(keys, 1, protected=(1, 2)) == plan.retention(keys, 1)


def test_what_a_node_holds_whole() -> None:
    ranges = plan.node_ranges([2, 2, 2, 2])  # 8 ranks; jump 2, factor 2: (0,2) (1,3) (4,6) (5,7)
    assert plan.held_ranks(8, 2, 2, ranges, me=0) == {0, 1, 2, 3}
    assert plan.held_ranks(8, 2, 2, ranges, me=3) == {4, 5, 6, 7}
    assert plan.held_ranks(8, 1, 2, ranges, me=1) == {2, 3}  # cliques within the node
    assert plan.held_ranks(8, None, None, ranges, me=1) == {2, 3}  # no replication
    assert plan.held_ranks(8, 4, 2, ranges, me=0) == {0, 1, 4, 5}
    # Own parts of 4 and 6, a replica of rank 2 at 4 only: 4 is the newest held whole.
    keys = [K(4, 0), K(4, 1), K(6, 0), K(6, 1), K(4, 2), K(6, 2, 8), K(6, 3, 8)]
    assert plan.newest_held_whole(keys, {0, 1, 2}, 4) == 4
    assert plan.newest_held_whole(keys, {0, 1}, 4) == 6
    assert plan.newest_held_whole(keys, {0, 1, 2, 3}, 4) == -1


def test_names_and_messages_are_validated() -> None:
    assert valid_session("default") and valid_session("a.b-c_1")
    for bad in ("", ".", "..", "...", "../x", "a/b", "x" * 129, "é", None, 3):
        assert not valid_session(bad)
    assert parse_iteration_dir("iter_0000042") == 42
    assert parse_iteration_dir("iter_042") is None and parse_iteration_dir("iter_00000042") is None
    assert parse_part_name("rank3-of8.ftckpt", 42) == PartKey(42, 3, 8)
    for name in ("rank8-of8.ftckpt", "rank03-of8.ftckpt", "rank3-of8.ftckpt.tmp-1", "x"):
        assert parse_part_name(name, 42) is None
    holdings = {S: {K(5, 0): 123}}
    assert decode_holdings(encode_holdings("a", holdings)) == holdings
    decision = Decision(1, False, {S: Choice(3, 4, "x")}, (0, 1), frozenset({2}))
    assert decode_decision(encode_decision(decision)) == decision
    outcome = Outcome({S: frozenset({1})})
    assert decode_outcome(encode_outcome(outcome)) == outcome
    for raw in ("[]", "{", '{"v": 2, "node": "a", "sessions": {}}',
                '{"v": 1, "node": "a", "sessions": {"..": []}}',
                '{"v": 1, "node": "a", "sessions": {"s": [[1, 4, 4, 1]]}}'):  # fmt: skip
        with pytest.raises(RestoreError):
            decode_holdings(raw)
    good = {"session": S, "iteration": 1, "rank": 0, "world_size": 4, "cycle": 1}
    assert parse_part_request(good, "cycle") == (S, K(1, 0), 1)
    for change in ({"session": "../etc"}, {"rank": 4}, {"iteration": True}, {"cycle": -1},
                   {"extra": 1}, {"world_size": 0}):  # fmt: skip
        with pytest.raises(PartRejectedError):
            parse_part_request({**good, **change}, "cycle")


def test_the_directory_is_private_and_falls_back_to_the_temp_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ftrun.agent")
    tier = NodeTier.create("run/1", (tmp_path,))
    assert tier.root.parent == tmp_path and tier.root.name.startswith(
        f"ftrun-ckpt-run_1-{os.getpid()}-"
    )
    assert stat.S_IMODE(tier.root.stat().st_mode) == 0o700
    tier.close()
    assert not tier.root.exists()
    fallback = NodeTier.create("r", (tmp_path / "absent",))
    try:
        assert fallback.root.parent == Path(tempfile.gettempdir())
        assert "absent or not writable" in caplog.text
    finally:
        fallback.close()


def test_a_dead_agents_directory_is_removed_by_the_next_keeper(tmp_path: Path) -> None:
    """An agent SIGKILLed cannot clean up; the next keeper on the node removes what it left,
    and never the directory of an agent that is alive."""
    code = (
        "import sys; from pathlib import Path; "
        "from ftrun.checkpointing.keeper.node_tier import NodeTier; "
        "t = NodeTier.create('dead', (Path(sys.argv[1]),)); print(t.root, flush=True); "
        "sys.stdin.read()"
    )
    dying = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert dying.stdout is not None
    left = Path(dying.stdout.readline().strip())
    (left / "session").mkdir()
    alive = NodeTier.create("alive", (tmp_path,))
    try:
        assert left.is_dir(), "removed while its agent was alive"
        dying.send_signal(signal.SIGKILL)
        dying.wait(timeout=30)
        dying.stdin.close()  # type: ignore[union-attr]
        dying.stdout.close()
        newcomer = NodeTier.create("new", (tmp_path,))
        try:
            assert not left.exists()
            assert alive.root.is_dir() and newcomer.root.is_dir()
        finally:
            newcomer.close()
    finally:
        alive.close()


def test_a_directory_without_its_lock_is_removed_only_after_a_grace_period(
    tmp_path: Path,
) -> None:
    """One being created right now has no lock yet: kept; an old one is abandoned."""
    young = tmp_path / "ftrun-ckpt-young"
    young.mkdir()
    other = tmp_path / "not-ours"
    other.mkdir()
    now = time.time()
    assert remove_abandoned(tmp_path, now=now) == []
    assert remove_abandoned(tmp_path, now=now + 3600) == [young]
    assert other.is_dir() and not young.exists()


# ---- keepers on 127.0.0.1 ---------------------------------------------------------------------


class Recorder:
    """The events a keeper emits, each checked against the schema."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        assert problems(event, fields) == []
        with self._lock:
            self.events.append((event, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [f for e, f in self.events if e == kind]


@dataclasses.dataclass
class Node:
    name: str
    peer: PeerService
    keeper: KeeperService
    events: Recorder

    @property
    def tier(self) -> NodeTier:
        return self.keeper.tier

    def write(self, session: str, key: PartKey) -> Path:
        """A part as the node's worker writes it."""
        path = self.tier.part_path(session, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_part(path, {"w": torch.arange(64) + key.rank, "it": key.iteration}, key.iteration)
        return path

    def restore_file(self, session: str = S) -> RestoreDecision:
        raw = read_json(self.tier.root / session / RESTORE_FILE)
        assert raw is not None
        return RestoreDecision.from_json(raw)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    threads_before = set(threading.enumerate())
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    nodes: list[Node] = []

    def make(name: str, settings: KeeperSettings = FAST) -> Node:
        store = TCPStore("127.0.0.1", master.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10))  # fmt: skip
        peer = PeerService(store, RUN, "127.0.0.1", name)
        events = Recorder()
        keeper = KeeperService(store, RUN, peer.server, peer.client, events, settings, (tmp_path,))
        nodes.append(Node(name, peer, keeper, events))
        return nodes[-1]

    yield make
    for node in nodes:
        node.keeper.close()
        node.peer.close()
        assert not node.tier.root.exists()
    wait_for(lambda: set(threading.enumerate()) <= threads_before, 10, "keeper threads to end")


def round_of(number: int, members: list[Node], lws: int = 2) -> list[Round]:
    """Each member's view of one round (group ranks in list order)."""
    descriptors = tuple(
        NodeDescriptor(n.name, "127.0.0.1", lws, 0, None, n.peer.server.port) for n in members
    )
    return [Round(number, descriptors, g) for g in range(len(members))]


def run_round(members: list[Node], rounds: list[Round], timeout: float = 30) -> None:
    """Every member's on_round at once, as the agents run it; all must finish in time."""
    threads = [
        threading.Thread(target=n.keeper.on_round, args=(r,), name=f"on_round {n.name}")
        for n, r in zip(members, rounds, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads)


def policy(node: Node, session: str = S, **fields: Any) -> None:
    write_json_atomically(node.tier.root / session / POLICY_FILE, TierPolicy(**fields).to_json())


def test_a_new_part_is_copied_to_the_clique_node(cluster: Any) -> None:
    a, b = cluster("a"), cluster("b")
    run_round([a, b], round_of(1, [a, b]))
    assert a.keeper.worker_env(round_of(1, [a, b])[0]) == {Env.CKPT_DIR: str(a.tier.root)}
    policy(a, replication_jump=2, replication_factor=2)
    policy(b, replication_jump=2, replication_factor=2)
    a.write(S, K(5, 0))  # cliques (0, 2) and (1, 3): rank 0's copy goes to node b
    b.write(S, K(5, 3))
    wait_for(lambda: b.tier.has(S, K(5, 0)) and a.tier.has(S, K(5, 3)), 10, "the copies")
    assert b.tier.listed(S) == [K(5, 0), K(5, 3)]
    (copied,) = wait_for(lambda: a.events.of("ckpt_replicated"), 5, "the event")
    assert (copied["iteration"], copied["rank"], copied["to"]) == (5, 0, ["b"])
    assert copied["bytes"] == a.tier.part_path(S, K(5, 0)).stat().st_size
    # Two new parts of one rank in one poll (held off by its lock): only the newest is copied.
    with a.keeper.replicator._lock:
        a.write(S, K(8, 0))
        a.write(S, K(9, 0))
    wait_for(lambda: b.tier.has(S, K(9, 0)), 10, "the newest copy")
    # The event follows the copy's arrival: wait for it too.
    wait_for(lambda: len(a.events.of("ckpt_replicated")) >= 2, 5, "the second event")
    assert not b.tier.has(S, K(8, 0))
    assert len(a.events.of("ckpt_replicated")) == 2


def test_malformed_pushes_are_refused_and_leave_nothing(cluster: Any) -> None:
    a, b = cluster("a"), cluster("b")
    run_round([a, b], round_of(3, [a, b]))
    good = a.write(S, K(5, 0))
    data = bytearray(good.read_bytes())
    address = ("127.0.0.1", b.peer.server.port)

    def push(fields: dict[str, Any], payload: Any) -> None:
        header = {"session": S, "iteration": 5, "rank": 0, "world_size": 4, "cycle": 3, **fields}
        with pytest.raises(PeerRemoteError):
            a.peer.client.push(*address, PUSH, header, payload, timeout=10)

    push({"session": "../../escape"}, bytes(data))
    push({"session": ".."}, bytes(data))
    push({"rank": 4}, bytes(data))
    push({"iteration": -1}, bytes(data))
    push({"cycle": 2}, bytes(data))  # from another round
    push({}, b"x" * 8)  # smaller than any part
    push({}, bytes(2 << 20))  # above the maximum
    push({"iteration": 6}, bytes(data))  # the header says 5
    corrupt = bytearray(data)
    corrupt[-3] ^= 0xFF  # a tensor byte: the CRC catches it
    push({}, bytes(corrupt))
    push({}, bytes(data[:-10]))  # truncated
    assert all(not list(d.iterdir()) for d in b.tier.root.rglob("iter_*"))
    assert sorted(p.name for p in b.tier.root.iterdir()) in ([OWNER_LOCK], [OWNER_LOCK, S])
    assert not (b.tier.root.parent / "escape").exists()
    # The same bytes, well named, are taken (zero-copy from the file).
    fd = os.open(good, os.O_RDONLY)
    try:
        assert push_part(a.peer.client, address, S, K(5, 0), 3, fd, len(data), 10)
    finally:
        os.close(fd)
    assert b.tier.has(S, K(5, 0))


def test_replicas_keep_the_newest_complete_parts(cluster: Any) -> None:
    a, b, c = cluster("a"), cluster("b", dataclasses.replace(FAST, keep_complete=1)), cluster("c")
    run_round([a, b, c], round_of(1, [a, b, c]))
    for iteration in (1, 2, 3):
        path = a.write(S, K(iteration, 0, 6))
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for node in (b, c):
                address = ("127.0.0.1", node.peer.server.port)
                push_part(a.peer.client, address, S, K(iteration, 0, 6), 1, f.fileno(), size, 10)
    assert b.tier.listed(S) == [K(3, 0, 6)]  # keep_complete=1
    assert c.tier.listed(S) == [K(2, 0, 6), K(3, 0, 6)]  # the default, 2
    assert a.tier.listed(S) == [K(1, 0, 6), K(2, 0, 6), K(3, 0, 6)]  # its own: the manager's


def test_a_replacement_node_fetches_its_ranks_and_both_restore(cluster: Any) -> None:
    a, b = cluster("a"), cluster("b")
    for key in [K(i, r) for i in (3, 5) for r in range(4)] + [K(9, 0)]:
        a.write(S, key)  # own ranks 0, 1, replicas of 2, 3; 9: a save nobody finished
    run_round([a, b], round_of(4, [a, b]))
    assert a.restore_file() == b.restore_file() == RestoreDecision(5, 4)
    assert b.tier.listed(S) == [K(5, 2), K(5, 3)]
    assert K(9, 0) not in a.tier.listed(S)  # above the restored iteration: a left timeline
    (event,) = b.events.of("ckpt_restore")
    assert (event["iteration"], event["fetched"], event["sources"]) == (5, 2, ["a"])
    assert event["bytes"] > 0 and event["attempts"] == 1
    # The next round restarts with every part in place: decided at once, nothing fetched.
    run_round([a, b], round_of(5, [a, b]))
    last = b.events.of("ckpt_restore")[-1]
    assert (last["iteration"], last["fetched"], last["attempts"]) == (5, 0, 0)


def test_a_node_lost_before_its_newest_replicas_arrive_leaves_a_whole_iteration(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """a and b replicate each other (cliques (0,2), (1,3)); 4 is whole on both. Then b's
    ranks' parts of 6 and 8 never reach a (b is lost before it sends them: its replicator is
    paused), while a's workers save 6 and 8 with the manager's clean-up (keep 2). a keeps its
    part of 4 all the same, so the replacement node c restores 4 from a's replicas. Without
    the protection a would hold 6 and 8 of its own ranks and 4 of b's only: no iteration
    complete, the job restarting from scratch."""
    a, b, c = cluster("a"), cluster("b"), cluster("c")
    run_round([a, b], round_of(1, [a, b]))
    for node in (a, b):
        policy(node, replication_jump=2, replication_factor=2)
    for node, ranks in ((a, (0, 1)), (b, (2, 3))):
        for rank in ranks:
            node.write(S, K(4, rank))
    wait_for(lambda: len(a.tier.listed(S)) == len(b.tier.listed(S)) == 4, 10, "the replicas")
    wait_for(lambda: a.tier.read_protected(S) == b.tier.read_protected(S) == (4, 4), 10, "4")
    (held,) = a.events.of("ckpt_held")  # the local tier of the live view
    assert (held["iteration"], held["stall"]) == (4, None)  # no manager wrote these parts
    b.keeper.replicator.pause()  # b's new parts stay on b: it is about to be lost
    monkeypatch.setenv(Env.CKPT_DIR, str(a.tier.root))
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        cliques = CliqueReplicationStrategy(replication_jump=2, replication_factor=2)
        manager = LocalCheckpointManager(tmp_path / "unused", S, cliques, persist_to_disk=False)
        for iteration in (6, 8):
            manager.save({"w": torch.arange(64) + rank}, iteration)
    wait_for(lambda: b.tier.has(S, K(8, 0)) and b.tier.has(S, K(8, 1)), 10, "a's 8 on b")
    own_new = [K(i, r) for i in (6, 8) for r in (0, 1)]
    assert a.tier.listed(S) == sorted([K(4, 0), K(4, 1), K(4, 2), K(4, 3), *own_new])
    assert a.tier.read_protected(S) == (4, 4)
    stall = a.tier.read_stall(S, (0, 1))  # how long the managers' saves blocked them
    assert stall is not None and 0 < stall < 10
    b.keeper.close()
    run_round([a, c], round_of(2, [a, c]))
    assert a.restore_file() == c.restore_file() == RestoreDecision(4, 4)
    assert c.tier.listed(S) == [K(4, 2), K(4, 3)]
    (event,) = c.events.of("ckpt_restore")
    assert (event["iteration"], event["fetched"], event["sources"]) == (4, 2, ["a"])


def test_a_holder_that_disappears_makes_the_job_fall_back(cluster: Any) -> None:
    """Iteration 5 is complete only with c's parts; c's agent stops serving after publishing
    its holdings: b cannot get rank 1, so every node falls back to 3 (complete on a)."""
    a, b, c = cluster("a"), cluster("b"), cluster("c")
    for key in (K(5, 0, 3), K(3, 0, 3), K(3, 1, 3), K(3, 2, 3)):
        a.write(S, key)
    for key in (K(5, 1, 3), K(5, 2, 3)):
        c.write(S, key)
    c.peer.server.close()
    run_round([a, b, c], round_of(6, [a, b, c], lws=1))
    for node in (a, b, c):
        assert node.restore_file() == RestoreDecision(3, 3)
    assert b.tier.listed(S) == [K(3, 1, 3)] and c.tier.listed(S) == [K(3, 2, 3)]
    (event,) = b.events.of("ckpt_restore")
    assert (event["iteration"], event["sources"], event["attempts"]) == (3, ["a"], 2)


def test_no_decision_in_time_restores_nothing(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The deciding node never comes: the other gives up at its deadline, -1, an ERROR."""
    a, b = cluster("a"), cluster("b", dataclasses.replace(FAST, gather_s=0.3))
    b.write(S, K(5, 2))
    started = time.monotonic()
    run_round([b], round_of(7, [a, b])[1:])
    assert time.monotonic() - started < 5
    assert b.restore_file() == RestoreDecision(-1, 4)
    assert any(r.levelno == logging.ERROR and "no restore decision" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # a comes late: the job-wide decision is already "nothing", and it follows it.
    a.write(S, K(5, 0))
    run_round([a], round_of(7, [a, b])[:1])
    assert a.restore_file() == RestoreDecision(-1, 4)


def test_a_malformed_policy_is_logged_once_and_copies_nothing(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = cluster("a"), cluster("b")
    run_round([a, b], round_of(1, [a, b]))
    (a.tier.root / S).mkdir()
    (a.tier.root / S / POLICY_FILE).write_text('{"replication_factor": "two"}')
    a.write(S, K(1, 0))
    a.write(S, K(2, 1))
    polled = a.keeper.replicator.polls
    wait_for(lambda: a.keeper.replicator.polls >= polled + 5, 10, "five more polls")
    complaints = [r for r in caplog.records if POLICY_FILE in r.getMessage()]
    assert len(complaints) == 1 and complaints[0].levelno == logging.WARNING
    assert not a.events.of("ckpt_replicated") and not b.tier.sessions()
    policy(a, replication_jump=2, replication_factor=2)
    a.write(S, K(3, 0))
    wait_for(lambda: b.tier.has(S, K(3, 0)), 10, "the copy once the policy is fixed")


def test_keeper_directory_in_node_memory_by_default() -> None:
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no writable /dev/shm here")
    tier = NodeTier.create(RUN)
    try:
        assert tier.root.parent == Path("/dev/shm")
    finally:
        tier.close()
    assert not tier.root.exists()


def test_a_keeper_that_fails_makes_the_whole_job_restore_nothing(
    cluster: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's keeper breaks while fetching: b's workers get -1 (and an ERROR line), and so do a's,
    so that no rank loads an iteration the others do not."""
    a, b = cluster("a"), cluster("b")
    for key in [K(5, r) for r in range(4)]:
        a.write(S, key)
    b.write(S, K(1, 2))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(b.keeper.tier, "install", broken)
    started = time.monotonic()
    run_round([a, b], round_of(8, [a, b]))
    assert time.monotonic() - started < 3  # a does not wait out its deadline
    assert a.restore_file() == b.restore_file() == RestoreDecision(-1, 4)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("restore failed (a bug)" in e for e in errors)
    # "Nothing" for the job: the parts belong to a timeline it left (see holdings.after_restore).
    assert a.tier.listed(S) == []
