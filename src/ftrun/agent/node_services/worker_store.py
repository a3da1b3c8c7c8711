"""The workers' store (`MASTER_ADDR:MASTER_PORT`), hosted by the round's first node's agent.

torch's `env://` rendezvous has rank 0's worker host the TCPStore unless the agent hosts it
(`TORCHELASTIC_USE_AGENT_STORE`). When rank 0 hosts it, every other rank that calls
`init_process_group` before rank 0's server listens is refused and retries after torch's
client back-off (500 ms, jittered 0.5-1.5x): measured on 4 x H200 with prestarted workers, the
ranks' process group took 0.11-0.55 s more than with a store already listening
(`bench/restart/cuda_standby_probe.py --store rank0|hosted`), on every restart. So the agent of
the round's first node starts a fresh store for each cycle, before any worker starts, and its
workers connect to it as clients; it is closed once they are gone. A fresh one per cycle: no
cycle reads keys that an earlier one's ranks wrote (torch's client adds no prefix per attempt;
torchrun's shared store hangs a restart for that reason, pytorch#135712).

Workers on the other nodes are clients either way. Where the store cannot be started (the port
taken meanwhile), rank 0 hosts it as before, with a warning.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ftrun.agent.worker_env import AGENT_STORE_ENV
from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger("ftrun.agent")

STORE_TIMEOUT = datetime.timedelta(minutes=30)
"""torch's default for a process group's store operations."""


class WorkerStoreService(NodeService):
    name = "worker-store"

    def __init__(self) -> None:
        self._server: TCPStore | None = None

    def on_round(self, rnd: Round) -> None:
        self._server = None  # its destructor stops the listener
        if rnd.group_rank != 0:
            return
        from torch.distributed import TCPStore

        try:
            self._server = TCPStore(
                rnd.master.host, rnd.master.master_port, is_master=True,
                wait_for_workers=False, timeout=STORE_TIMEOUT, use_libuv=True,
            )  # fmt: skip
        except (RuntimeError, OSError) as exc:
            log.warning("the workers' store on port %d: %s; rank 0 hosts it",
                        rnd.master.master_port, exc)  # fmt: skip

    def worker_env(self, rnd: Round) -> Mapping[str, str]:
        # on_round ran first: the server, if any, is this round's.
        return {AGENT_STORE_ENV: str(self._server is not None)}

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._server = None

    def close(self) -> None:
        self._server = None
