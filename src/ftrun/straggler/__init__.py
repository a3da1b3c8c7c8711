"""Straggler detection with NVIDIA Resiliency Extension's API, off the training path.

Workers time sections (`Detector.detection_section`, `Detector.wrap_callables`); under
ft_launcher the durations ride the rank monitor's channel to the node's agent, the agents
compute relative and individual scores every `--ft-straggler-report-interval` seconds and
publish the report, which `Detector.generate_report_if_interval_elapsed()` returns;
`Detector.generate_report()` computes one now, in-process, as NVRx's. See README "Straggler
detection". Importing this package does not import torch.
"""

from ftrun.straggler.detector import CallableId, Detector
from ftrun.straggler.report import Report, StragglerId
from ftrun.straggler.statistics import Statistic

__all__ = ["CallableId", "Detector", "Report", "Statistic", "StragglerId"]
