"""Straggler detection with NVIDIA Resiliency Extension's API, off the training path.

Workers time sections (`Detector.detection_section`, `Detector.wrap_callables`); under
ft_launcher the durations ride the rank monitor's channel to the node's agent, the agents
compute relative and individual scores every `--ft-straggler-report-interval` seconds and
publish the report, which `Detector.generate_report_if_interval_elapsed()` returns;
`Detector.generate_report()` computes one now, in-process, as NVRx's. See docs/straggler.md.
Importing this package imports nothing else: its names load when first used, so that
`ftrun.config` (which reads `straggler.config`) does not load the worker's detector.
"""

from __future__ import annotations

from ftrun.lazy import lazy_getattr

_LAZY = {
    "CallableId": "ftrun.straggler.detector",
    "Detector": "ftrun.straggler.detector",
    "Report": "ftrun.straggler.report",
    "StragglerId": "ftrun.straggler.report",
    "Statistic": "ftrun.straggler.statistics",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["CallableId", "Detector", "Report", "Statistic", "StragglerId"]
