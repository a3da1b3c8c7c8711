"""The in-worker client. Importing it must not import torch."""

from ftrun.client_lib.client import RankMonitorClient
from ftrun.errors import RankMonitorClientError

__all__ = ["RankMonitorClient", "RankMonitorClientError"]
