"""NVRx 0.7's straggler `Detector.initialize` arguments under ft_launcher, from its docs."""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable

import pytest

from ftrun.rank_monitor.timings import DetectorSettings, TimingBatch
from ftrun.straggler import Detector, Statistic


def test_per_worker_report_settings_go_to_the_agent_under_the_launcher(
    make_server: Callable, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NVRx's per-worker `report_time_interval` and `node_name` reach the node's agent, which
    reports on that interval when the launcher was given none, and names the node so in its
    reports (tests/test_straggler_adopt.py); the worker has nothing to warn about."""
    got: queue.SimpleQueue[TimingBatch] = queue.SimpleQueue()
    server = make_server()
    server._on_timings = got.put  # the fixture builds servers without this callback
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    with caplog.at_level(logging.WARNING, "ftrun.straggler"):
        Detector.initialize(report_time_interval=5, node_name="gpu-node-7")
    try:
        batch = got.get(timeout=10)
        assert (batch.rank, batch.sections) == (0, ())
        assert batch.settings == DetectorSettings(5.0, "gpu-node-7")
    finally:
        Detector.shutdown()
    with caplog.at_level(logging.WARNING, "ftrun.straggler"):
        Detector.initialize()  # NVRx's defaults: 60 s, the host's name
    try:
        assert got.get(timeout=10).settings == DetectorSettings(60.0, None)
    finally:
        Detector.shutdown()
    assert caplog.text == ""


def test_generate_report_computes_now_under_the_launcher_as_nvrx_s_does(
    make_server: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRx's `generate_report()` reports the durations since the last call at once; under
    ft_launcher it did not before the agents' first report (60 s by default)."""
    server = make_server()
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    Detector.initialize(node_name="gpu-node-7")
    try:
        for _ in range(3):
            with Detector.detection_section("fwd", profile_cuda=False):
                pass
        report = Detector.generate_report()
        assert report is not None and report.local_section_summaries["fwd"][Statistic.NUM] == 3
        assert report.rank_to_node == {0: "gpu-node-7"}
        assert Detector.latest_launcher_report() is None  # the agents have not reported yet
        assert Detector.generate_report().local_section_summaries == {}  # nothing new
    finally:
        Detector.shutdown()
