"""NVRx 0.7's straggler `Detector.initialize` arguments under ft_launcher, from its docs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import pytest

from ftrun.straggler import Detector


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
        assert "node_name='gpu-node-7' is not used under ft_launcher" in caplog.text
    finally:
        Detector.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "ftrun.straggler"):
        Detector.initialize()  # NVRx's defaults: nothing to say
    Detector.shutdown()
    assert caplog.text == ""
