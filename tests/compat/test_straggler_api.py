"""NVRx 0.7's straggler `Detector.initialize` arguments under ft_launcher, from its docs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import pytest

from ftrun.straggler import Detector, Statistic


def test_per_worker_report_settings_are_warned_about_under_the_launcher(
    make_server: Callable, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The agents report on the launcher's clock and name nodes as the launchers do: NVRx's
    per-worker `report_time_interval` and `node_name` are said to be unused, not dropped."""
    server = make_server()
    for key, value in {**server.worker_env(), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    server.expect_rank(0, os.getpid())
    with caplog.at_level(logging.WARNING, "ftrun.straggler"):
        Detector.initialize(report_time_interval=5, node_name="gpu-node-7")
    try:
        assert "report_time_interval=5 is not used under ft_launcher" in caplog.text
        assert "node_name='gpu-node-7' names this rank's node in generate_report()" in caplog.text
    finally:
        Detector.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "ftrun.straggler"):
        Detector.initialize()  # NVRx's defaults: nothing to say
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
