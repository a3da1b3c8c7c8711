"""The in-worker client. Importing it must not import torch."""

from ftrun.client_lib.client import RankMonitorClient
from ftrun.errors import RankMonitorClientError
from ftrun.rank_monitor.workload import WorkloadAction, WorkloadControlRequest

__all__ = [
    "RankMonitorClient",
    "RankMonitorClientError",
    "WorkloadAction",
    "WorkloadControlRequest",
]
