"""The worker side of straggler detection: NVRx's Detector API without a launcher, the TIMINGS
frames, and a real rank monitor server handing batches to its owner."""

from __future__ import annotations

import os
import queue
import sys
import textwrap
import time
import types

import msgpack
import pytest

from ftrun.errors import ProtocolError
from ftrun.rank_monitor import protocol as wire
from ftrun.rank_monitor.timings import SectionTimes, TimingBatch
from ftrun.straggler import CallableId, Detector, Statistic
from ftrun.straggler.channel import MonitorChannel
from support import run_gloo_ranks, wait_for


@pytest.fixture
def detector(monkeypatch):
    for name in ("FTRUN_MONITOR_ADDR", "FTRUN_IPC_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    yield Detector
    Detector.shutdown()


def test_sections_are_timed_locally_without_a_launcher(detector):
    with pytest.raises(RuntimeError, match="not initialized"):
        Detector.detection_section("x")
    with pytest.raises(RuntimeError, match="should not be instantiated"):
        Detector()
    detector.initialize(profiling_interval=2)
    with pytest.raises(RuntimeError, match="already"):
        detector.initialize()
    for _ in range(6):
        with detector.detection_section("step", profile_cuda=False):
            time.sleep(0.002)
    with pytest.raises(ValueError), detector.detection_section("step", profile_cuda=False):
        raise ValueError("a failed step is not a duration")
    line = sys._getframe().f_lineno + 1
    with detector.detection_section():  # named after its place in the code
        pass
    report = detector.generate_report()
    summary = report.local_section_summaries["step"]
    assert summary[Statistic.NUM] == 3  # every 2nd entry (profiling_interval)
    assert 2.0 <= summary[Statistic.MED] < 50
    assert report.section_relative_perf_scores["step"] == {0: 1.0}
    assert report.rank == 0 and report.rank_to_node
    assert f"{__file__}:{line}" in report.local_section_summaries


def test_wrapped_callables_are_timed_and_restored(detector):
    target = types.SimpleNamespace(step=lambda x: x + 1)
    original = target.step
    detector.initialize(gather_on_rank0=False, scores_to_compute=["relative_perf_scores"])
    callable_id = CallableId(target, "step")
    detector.wrap_callables([callable_id])
    assert target.step is not original and target.step(1) == 2
    report = detector.generate_report()
    assert report.local_section_summaries[str(callable_id)][Statistic.NUM] == 1
    assert report.section_individual_perf_scores == {} and report.rank == 0
    detector.restore_original_callables()
    assert target.step is original


def test_the_interval_is_agreed_in_steps(detector):
    detector.initialize(report_time_interval=0.05)
    reports = []
    for _ in range(40):
        with detector.detection_section("step"):
            time.sleep(0.005)
        reports.append(detector.generate_report_if_interval_elapsed())
    due = [i for i, r in enumerate(reports) if r is not None]
    assert due and all(not reports[i] for i in range(16))  # the first 16 steps estimate
    assert detector.is_interval_elapsed() == (reports[-1] is not None)


GATHER = textwrap.dedent(
    """
    import time, torch.distributed as dist
    from ftrun.straggler import Detector
    dist.init_process_group("gloo")
    Detector.initialize()
    slow = 1.5 if dist.get_rank() == 1 else 1.0
    for _ in range(10):
        with Detector.detection_section("step"):
            time.sleep(0.01 * slow)
    report = Detector.generate_report()
    found = report.identify_stragglers() if report else None
    print(found and sorted(s.rank for s in found["straggler_sections_relative"]["step"]))
    Detector.shutdown()
    dist.destroy_process_group()
    """
)


def test_without_a_launcher_ranks_are_gathered_with_collectives():
    assert run_gloo_ranks(GATHER, [], timeout=60) == ["[1]", "None"]


# ---- the wire and the server -------------------------------------------------------------------


def test_timings_frames_round_trip_and_are_validated():
    message = wire.Timings(
        3, 99, (SectionTimes("step", False, (1, 2)), SectionTimes("s", True, ()))
    )
    assert wire.decode(wire.encode(message)) == message
    for fields in (
        [3, 99, [["step", 1, [1]]]],
        [3, 99, [["step", False, [-1]]]],
        [3, 99, [["step", False, [1.5]]]],
        [3, 99, [["", False, [1]]]],
        [3, 99, "x"],
        [3, 99],
    ):
        with pytest.raises(ProtocolError):
            wire.decode(msgpack.packb([1, "tm", *fields], use_bin_type=True))


def test_the_server_hands_batches_of_spawned_ranks_to_its_owner(make_server):
    got: queue.SimpleQueue[TimingBatch] = queue.SimpleQueue()
    server = make_server()
    server._on_timings = got.put  # the fixture builds servers without this callback
    server.expect_rank(2, os.getpid())
    channel = MonitorChannel(server.address, 2)
    stranger = MonitorChannel(server.address, 5)  # rank 5 was never spawned here
    try:
        stranger.take([("step", False, [7])])
        channel.take([("step", False, list(range(10_000))), ("step", True, [5])])
        first = got.get(timeout=10)
        second = got.get(timeout=10)  # 10,000 durations do not fit one frame: two batches
        assert (first.rank, first.worker_pid) == (2, os.getpid())
        durations = [
            d for b in (first, second) for s in b.sections if not s.gpu for d in s.durations
        ]
        assert durations == list(range(10_000))
        assert any(s.gpu and s.durations == (5,) for b in (first, second) for s in b.sections)
        wait_for(lambda: server.dropped_messages == 1, 5, "the stranger's batch to be dropped")
        assert got.empty()
    finally:
        channel.close()
        stranger.close()
