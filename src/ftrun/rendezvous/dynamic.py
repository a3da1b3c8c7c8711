"""Dynamic rendezvous (v1): torch's DynamicRendezvousHandler on the c10d backend, extended.

torch decides who is in a round and in which order; we add what the barrier rendezvous has:
the node descriptors (exchanged once per cycle through the store), infra-group-rank ordering,
health gating (stop waiting when too many nodes reported themselves unhealthy), and the
job-wide cycle/restart signalling of `control.JobControl`. Kept for users of NVRx's first
rendezvous and of torchrun; the barrier one is the default and scales better.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from ftrun.aside import Aside
from ftrun.config.rendezvous import RendezvousConfig
from ftrun.rendezvous.control import job_control
from ftrun.rendezvous.errors import JoinInterruptedError
from ftrun.rendezvous.ranks import NodeDescriptor, Round, order_nodes

BACKEND = "ftrun-dynamic"
_POLL_S = 0.1
# One store op per node per poll: 1024 waiting nodes cost ~1,000 store ops/s at 1 s, not 10,000.
_HEALTH_POLL_S = 1.0


class DynamicRendezvous:
    """torch's dynamic handler plus descriptors, infra ranks, health gating and job control."""

    def __init__(
        self, config: RendezvousConfig, store: Store, descriptor: Callable[[], NodeDescriptor]
    ) -> None:
        self._config = config
        self._store = store
        self.control = job_control(store, config.run_id)
        self._prefix = self.control.prefix
        self._descriptor = descriptor
        timeout = RendezvousTimeout(join=_seconds(config.join_timeout),
                                    last_call=_seconds(config.last_call_timeout),
                                    close=_seconds(config.close_timeout))  # fmt: skip
        self.handler = DynamicRendezvousHandler.from_backend(
            run_id=config.run_id, store=store, backend=C10dRendezvousBackend(store, config.run_id),
            min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
            timeout=timeout,
        )  # fmt: skip

    def join(self, interrupted: Callable[[], bool]) -> Round:
        """One torch round, then the descriptor exchange for the job's current cycle."""
        cycle_at_start = self.control.cycle()
        info = self._next_rendezvous(interrupted, cycle_at_start)
        cycle = self.control.cycle()
        self._store.set(self._key(cycle, f"node/{info.rank}"), self._descriptor().to_json())
        keys = [self._key(cycle, f"node/{rank}") for rank in range(info.world_size)]
        arrivals = [NodeDescriptor.from_json(raw) for raw in self._store.multi_get(keys)]
        nodes = order_nodes(arrivals, self._config.use_infra_group_rank)
        return Round(cycle, nodes, nodes.index(arrivals[info.rank]))

    def restore(self) -> None:
        """Nothing: torch's rendezvous state starts again from the restored cycle's round."""

    def num_nodes_waiting(self, cycle: int | None = None) -> int:
        return self.handler.num_nodes_waiting()  # torch's: the current round only

    def _next_rendezvous(self, interrupted: Callable[[], bool], cycle: int) -> RendezvousInfo:
        """torch's call blocks until its own deadline; run it aside so that signals and
        unhealthy peers can end the wait early."""
        call = Aside(self.handler.next_rendezvous, "dynamic-rendezvous")
        next_health_poll = time.monotonic() + _HEALTH_POLL_S
        while not call.done(_POLL_S):
            if interrupted():
                raise JoinInterruptedError
            if time.monotonic() >= next_health_poll:
                next_health_poll += _HEALTH_POLL_S
                self.control.healthy_capacity(cycle, self._config.min_nodes, self._config.max_nodes)
        return call.result()

    def _key(self, cycle: int, name: str) -> str:
        return f"{self._prefix}/dyn/c{cycle}/{name}"


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)
