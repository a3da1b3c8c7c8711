"""The node's rank monitor: wire protocol, per-rank progress tracking, hang verdicts.

The server's names load on first use (PEP 562): the in-worker client imports the protocol and
the environment contract from this package, and must pull in neither the server nor psutil.
The workload control names are light, and load with the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftrun.config.monitor import RankMonitorConfig
from ftrun.lazy import lazy_getattr
from ftrun.rank_monitor.records import FirstProgress, ProgressSnapshot, Verdict
from ftrun.rank_monitor.tracker import HangKind
from ftrun.rank_monitor.workload import WorkloadAction, WorkloadControl, WorkloadControlRequest

if TYPE_CHECKING:
    from ftrun.rank_monitor.server import RankMonitorServer

_FROM_SERVER = ("RankMonitorServer",)

__all__ = [
    "FirstProgress",
    "HangKind",
    "ProgressSnapshot",
    "RankMonitorConfig",
    "RankMonitorServer",
    "Verdict",
    "WorkloadAction",
    "WorkloadControl",
    "WorkloadControlRequest",
]


__getattr__ = lazy_getattr(__name__, dict.fromkeys(_FROM_SERVER, "ftrun.rank_monitor.server"))
