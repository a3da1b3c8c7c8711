"""The agents adopt the workers' `report_time_interval` and `node_name` (NVRx's
`Detector.initialize` arguments) when the launcher was given no interval: the pure choice, the
wire frame that carries the settings, the node record, and two node services agreeing through
one store (threads, no processes)."""

from __future__ import annotations

import logging
import os
import queue
from pathlib import Path

import msgpack
import pytest
from torch.distributed import HashStore

from ftrun.config.straggler import DEFAULT_REPORT_INTERVAL, StragglerConfig
from ftrun.errors import ProtocolError
from ftrun.ft_launcher.options import BY_NAME
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.timings import DetectorSettings, SectionTimes, TimingBatch
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from ftrun.straggler import Detector
from ftrun.straggler.adopt import (
    choose_interval,
    choose_name,
    followed,
    published_interval,
)
from ftrun.straggler.assemble import (
    asked_intervals,
    assemble_columns,
    decode_node,
    encode_node,
    rank_record,
)
from ftrun.straggler.decide import findings
from ftrun.straggler.scores import History
from ftrun.straggler.service import StragglerService
from support import wait_for

MS = 1_000_000

# ---- the choice (pure) -------------------------------------------------------------------------


def test_without_the_flag_the_ranks_interval_is_used():
    default = choose_interval(None, {})
    assert (default.value, default.source, default.conflict) == (60.0, "default", None)
    agreed = choose_interval(None, {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0})
    assert (agreed.value, agreed.source, agreed.conflict) == (2.0, "workers", None)


def test_ranks_that_disagree_get_the_smallest_and_one_warning_line():
    choice = choose_interval(None, {0: 2.0, 1: 1.0, 2: 2.0, 3: 2.0, 5: 2.0})
    assert (choice.value, choice.source) == (1.0, "workers")
    assert choice.conflict == (
        "ranks disagree: ranks 0,2-3,5 asked 2 s; rank 1 asked 1 s; the smallest, 1 s, is used"
    )
    assert "\n" not in choice.conflict
    # The same disagreement, with more ranks arriving, is the same warning (once per agent).
    later = choose_interval(None, {0: 2.0, 1: 1.0, 2: 2.0, 3: 2.0, 4: 1.0, 5: 2.0})
    assert choice.key == later.key
    assert choose_interval(None, {0: 2.0, 1: 0.5}).key != choice.key


def test_the_flag_wins_over_the_ranks_with_one_warning_line():
    assert choose_interval(5.0, {}) == choose_interval(5.0, {0: 5.0, 1: 5.0})
    quiet = choose_interval(5.0, {0: 5.0})
    assert (quiet.value, quiet.source, quiet.conflict) == (5.0, "launcher", None)
    loud = choose_interval(5.0, {rank: 2.0 for rank in range(40)} | {40: 5.0})
    assert (loud.value, loud.source) == (5.0, "launcher")
    assert loud.conflict == (
        "--ft-straggler-report-interval=5 s is used: it was given, and ranks 0-39 asked 2 s "
        "(a report_time_interval given to Detector.initialize)"
    )
    # Ranks that ask the flag's value are no news: the warning is not repeated for them.
    assert choose_interval(5.0, {0: 2.0, 1: 5.0}).key == choose_interval(5.0, {0: 2.0}).key


def test_many_ranks_are_listed_in_short():
    choice = choose_interval(None, {rank: 1.0 + rank % 2 for rank in range(100)})
    assert choice.conflict is not None and len(choice.conflict) < 200
    assert "ranks 0,2,4,6,8,10,12,14,... asked 1 s" in choice.conflict


def test_a_node_reports_on_the_flag_else_the_reporting_node_s_choice_else_its_own():
    own = choose_interval(None, {0: 2.0})
    assert followed(None, own, None) == 2.0
    assert followed(None, own, 1.0) == 1.0  # the reporting node chose for every node
    assert followed(3.0, choose_interval(3.0, {0: 2.0}), 1.0) == 3.0
    assert published_interval({"interval": 1.5}) == 1.5
    for bad in ({}, {"interval": 0}, {"interval": True}, {"interval": "2"},
                {"interval": float("inf")}, {"interval": float("nan")}):  # fmt: skip
        assert published_interval(bad) is None, bad


def test_the_node_name_is_the_ranks_one_else_the_agent_s():
    assert choose_name("host-1", {0: None, 1: None}).value is None
    agreed = choose_name("host-1", {0: "rack7-n3", 1: "rack7-n3", 2: None})
    assert (agreed.value, agreed.conflict) == ("rack7-n3", None)
    split = choose_name("host-1", {0: "b", 1: "a", 2: "b"})
    assert split.value == "a"
    assert split.conflict == (
        "ranks of node host-1 disagree: ranks 0,2 gave node_name='b'; rank 1 gave "
        "node_name='a'; the smallest, 'a', is used"
    )


def test_not_given_is_told_apart_from_the_default():
    opt = BY_NAME["straggler_report_interval"]
    assert opt.default is None and StragglerConfig().report_interval is None
    assert opt.parse(None) is None and opt.parse("2.5") == 2.5
    with pytest.raises(ValueError):
        opt.parse("0")
    assert DEFAULT_REPORT_INTERVAL == 60.0


# ---- the wire ----------------------------------------------------------------------------------


def test_the_settings_ride_a_version_3_timings_frame():
    settings = DetectorSettings(2.0, "rack7-n3")
    message = wire.Timings(3, 99, (), settings)
    frame = wire.encode(message)
    assert msgpack.unpackb(frame)[:2] == [3, "tm"]
    assert wire.decode(frame) == message
    assert wire.decode(wire.encode(wire.Timings(3, 99, (), DetectorSettings(1.0)))).settings == (
        DetectorSettings(1.0, None)
    )
    plain = wire.Timings(3, 99, (SectionTimes("step", False, (1,)),))
    assert msgpack.unpackb(wire.encode(plain))[0] == 1  # durations alone: the version-1 frame
    for settings_wire in ([0, None], [-1.0, None], [float("nan"), None], [True, None],
                          [1e9, None], ["2", None], [2.0, ""], [2.0, 7], [2.0, "a\nb"],
                          [2.0, "x" * 300], [2.0], "x"):  # fmt: skip
        with pytest.raises(ProtocolError):
            wire.decode(msgpack.packb([3, "tm", 3, 99, [], settings_wire]))
    with pytest.raises(ProtocolError, match="takes 4 fields"):
        wire.decode(msgpack.packb([3, "tm", 3, 99, []]))


def test_settings_the_agent_cannot_adopt_are_one_warning_in_the_rank_s_log(
    make_server, monkeypatch, caplog
):
    got: queue.SimpleQueue[TimingBatch] = queue.SimpleQueue()
    server = make_server()
    server._on_timings = got.put  # the fixture builds servers without this callback
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    with caplog.at_level(logging.WARNING, "ftrun.straggler"):
        Detector.initialize(report_time_interval=float("inf"), node_name="a\nb")
    try:
        assert caplog.text.count("the launcher cannot adopt report_time_interval=inf") == 1
        with Detector.detection_section("step", profile_cuda=False):
            pass
        assert Detector.latest_launcher_report() is None  # flushes the batch to the agent
        first = got.get(timeout=10)
        assert first.settings is None and first.sections[0].name == "step"  # nothing before it
    finally:
        Detector.shutdown()
    # Without the launcher any value is taken, as NVRx takes it.
    monkeypatch.delenv("FTRUN_MONITOR_ADDR")
    Detector.initialize(report_time_interval=float("inf"))
    Detector.shutdown()


# ---- the node record and the report ------------------------------------------------------------


def records(node: str, ranks: dict[int, float]) -> dict:
    return {
        rank: rank_record(rank, node, {("step", False): [int(ms * MS)] * 5}, History())
        for rank, ms in ranks.items()
    }


def test_node_records_carry_the_name_and_the_asks_and_old_records_still_read():
    raw = encode_node(1, "host-1-77", records("host-1-77", {0: 20, 1: 28}), "n1", {0: 2, 1: 1.0})
    seq, cols = decode_node(raw)
    assert (seq, cols.label, asked_intervals(cols)) == (1, "n1", {0: 2.0, 1: 1.0})
    old = encode_node(1, "host-2-78", records("host-2-78", {2: 20}))
    assert decode_node(old)[1].label is None and asked_intervals(decode_node(old)[1]) == {}
    report = assemble_columns([cols, decode_node(old)[1]], 1)
    assert report.rank_to_node == {0: "n1", 1: "n1", 2: "host-2-78"}
    # The agents act on (and write events with) their own names, not the ranks' node_name.
    agents = {0: "host-1-77", 1: "host-1-77", 2: "host-2-78"}
    (finding,) = findings(report, StragglerConfig(), agents)
    assert (finding.rank, finding.node) == (1, "host-1-77")
    assert findings(report, StragglerConfig())[0].node == "n1"
    for bad_asks in ('{"x": 1}', '{"1": 0}', '{"1": true}', "[1]"):
        body = raw.decode().replace('"asks":{"0":2,"1":1.0}', f'"asks":{bad_asks}')
        assert body != raw.decode()
        with pytest.raises(ValueError, match="malformed"):
            decode_node(body.encode())


# ---- two node services, one store (threads) ----------------------------------------------------


class Node:
    """A node service of a 2-node round over a shared HashStore, fed as its monitor would."""

    def __init__(self, tmp: Path, store: HashStore, index: int, config: StragglerConfig):
        job = tmp / f"job{index}"
        job.mkdir()
        self.name = f"node{index}"
        self.service = StragglerService(
            config, store, "run", self.name, job, tmp, 1, lambda *a, **k: None, lambda _: None
        )
        nodes = tuple(NodeDescriptor(f"node{i}", "127.0.0.1", 2, 0) for i in range(2))
        self.service.on_round(Round(0, nodes, index))
        self.ranks = (2 * index, 2 * index + 1)

    def initialize(self, interval: float, node_name: str | None = None) -> None:
        for rank in self.ranks:
            self.service.on_timings(
                TimingBatch(rank, 100 + rank, (), 0.0, DetectorSettings(interval, node_name))
            )

    def step(self, ms: float = 20.0) -> None:
        for rank in self.ranks:
            sections = (SectionTimes("step", False, (int(ms * MS),) * 3),)
            self.service.on_timings(TimingBatch(rank, 100 + rank, sections, 0.0))


@pytest.fixture
def two_nodes(tmp_path):
    made: list[Node] = []

    def make(config: StragglerConfig) -> tuple[Node, Node]:
        store = HashStore()
        made.extend(Node(tmp_path, store, index, config) for index in range(2))
        return made[0], made[1]

    yield make
    for node in made:
        node.service.close()


def run_until(nodes: tuple[Node, ...], predicate, what: str, timeout: float = 10):
    """Feed every node's ranks a step each 20 ms (their training) until `predicate()`."""

    def fed() -> object:
        for node in nodes:
            node.step()
        return predicate()

    return wait_for(fed, timeout, what, interval=0.02)


def test_two_nodes_adopt_the_smallest_interval_their_ranks_asked(two_nodes, caplog):
    caplog.set_level(logging.INFO, logger="ftrun.agent")
    leader, other = nodes = two_nodes(StragglerConfig())
    assert leader.service.interval == other.service.interval == DEFAULT_REPORT_INTERVAL
    leader.initialize(0.3, "rack-a")
    other.initialize(0.15)
    # Each node takes its own ranks' interval at once (woken by their settings, not in 60 s),
    # then the reporting node (group rank 0) sees the other's asks and both report every 0.15 s.
    run_until(nodes, lambda: other.service.interval == 0.15, "node1 to take its ranks' 0.15 s")
    board = leader.service._board
    report = run_until(
        nodes, lambda: (r := board.read_report(0)) and r["interval"] == 0.15 and r, "a report"
    )
    assert leader.service.interval == other.service.interval == 0.15
    assert {report["rank_to_node"][str(r)] for r in leader.ranks} == {"rack-a"}
    assert {report["rank_to_node"][str(r)] for r in other.ranks} == {"node1"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "straggler detector: ranks disagree: ranks 0-1 asked 0.3 s; ranks 2-3 asked 0.15 s; "
        "the smallest, 0.15 s, is used"
    ]


def test_the_flag_wins_and_a_rank_asking_otherwise_is_one_warning(two_nodes, caplog):
    caplog.set_level(logging.INFO, logger="ftrun.agent")
    leader, other = nodes = two_nodes(StragglerConfig(report_interval=0.2))
    leader.initialize(1.0)
    other.initialize(0.2)
    board = leader.service._board
    run_until(nodes, lambda: (r := board.read_report(0)) and r["seq"] >= 3, "three reports")
    assert leader.service.interval == other.service.interval == 0.2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "straggler detector: --ft-straggler-report-interval=0.2 s is used: it was given, and "
        "ranks 0-1 asked 1 s (a report_time_interval given to Detector.initialize)"
    ]
