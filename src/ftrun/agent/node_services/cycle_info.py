"""What a worker may want to know about its cycle, as a small JSON file: a node service.

Before each cycle's workers start, `<job dir>/cycle-info.json` is replaced (written aside, then
renamed, so a reader never sees half a file) and every worker gets its path in
`FTRUN_CYCLE_INFO`. Fields: `job_id` (the rendezvous id), `attempt` (the scheduler's relaunch
count: `SLURM_RESTART_COUNT`, else 0), `cycle`, `nodes` (names in group-rank order),
`group_rank`, `world_size`, `ranks` (this node's global ranks), `last_cycle_ended` (why the
previous cycle ended, or null for the first); and what node services add (`metrics`, `status`:
the URLs of the live view, when it is on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from ftrun.environment import Env
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService

FILE_NAME = "cycle-info.json"


class CycleInfoService(NodeService):
    name = "cycle info"

    def __init__(
        self,
        job_dir: Path,
        job_id: str,
        environ: Mapping[str, str],
        cause_of: Callable[[int], str | None],
        described: Mapping[str, object] | None = None,
    ) -> None:
        """`cause_of(cycle)`: why that cycle ended (from the job's control keys), or None;
        `described`: fields the node's services set (`ServiceContext.describe`)."""
        self.path = job_dir / FILE_NAME
        self._job_id = job_id
        self._attempt = _attempt(environ)
        self._cause_of = cause_of
        self._described = described if described is not None else {}

    def worker_env(self, rnd: Round) -> Mapping[str, str]:
        return {Env.CYCLE_INFO: str(self.path)}

    def on_round(self, rnd: Round) -> None:
        first = rnd.first_global_rank
        info = {
            "job_id": self._job_id,
            "attempt": self._attempt,
            "cycle": rnd.number,
            "nodes": [n.node for n in rnd.nodes],
            "group_rank": rnd.group_rank,
            "world_size": rnd.world_size,
            "ranks": list(range(first, first + rnd.me.local_world_size)),
            "last_cycle_ended": self._cause_of(rnd.number - 1) if rnd.number > 0 else None,
            **{k: v for k, v in self._described.items() if v is not None},
        }
        aside = self.path.with_suffix(".tmp")
        aside.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        os.replace(aside, self.path)


def _attempt(environ: Mapping[str, str]) -> int:
    try:
        return int(environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0
