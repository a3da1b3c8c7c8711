"""The node's rank monitor: wire protocol, per-rank progress tracking, hang verdicts."""

from ftrun.rank_monitor.config import RankMonitorConfig
from ftrun.rank_monitor.server import RankMonitorServer, Verdict
from ftrun.rank_monitor.tracker import HangKind

__all__ = ["HangKind", "RankMonitorConfig", "RankMonitorServer", "Verdict"]
