"""The node's RankMonitorServer as a node service: started with the agent, its address in every
worker's environment, its verdicts (and progress notes) on the agent's inbox."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ftrun.rank_monitor import RankMonitorConfig, RankMonitorServer
from ftrun.rank_monitor.timings import TimingBatch
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService, Post


class MonitorService(NodeService):
    name = "rank monitor"

    def __init__(
        self,
        config: RankMonitorConfig,
        job_dir: Path,
        post: Post,
        on_timings: Callable[[TimingBatch], None] | None = None,
    ) -> None:
        self.server = RankMonitorServer(
            config, job_dir=job_dir, on_verdict=post, on_progress=post, on_control=post,
            on_timings=on_timings, on_inprocess=post,
        ).start()  # fmt: skip

    def worker_env(self, rnd: Round) -> Mapping[str, str]:
        return self.server.worker_env()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self.server.forget_all()

    def close(self) -> None:
        self.server.stop()
