"""Barrier rendezvous (v2): O(1) store writes per node per round and one bulk read.

Round `c` (the job's cycle number, see `control`): each node `add`s itself to
`c<c>/arrivals` (its arrival index), writes its descriptor to `c<c>/node/<index>` and waits on
`c<c>/closed`, which holds the round size. The arrival that fills `max_nodes` closes the round;
with `--nnodes=MIN:MAX` a node that has seen MIN arrivals for `last_call_timeout` closes it with
the count at that moment (compare-and-set: the first close wins). Before closing, the closer
reads the first `size` descriptors once and publishes them as one value `c<c>/round/<size>`
(compressed `NodeDescriptor.to_row` rows, each led by its descriptor version), so each
participant does one `get` of ~10 bytes per node and one decode instead of N key reads and N
decodes (O(N^2) work per round made 1024 nodes slow). A descriptor of another version goes
into the round as a `[version, node]` stub that every participant refuses alike
(`DescriptorVersionError`), not only the closer. Nodes whose index is not below the size are
late: they wait for the cycle to end and join the next round.
Every participant orders the descriptors the same way (`ranks.order_nodes`).
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ftrun.errors import ExitCode
from ftrun.rendezvous.config import RendezvousConfig
from ftrun.rendezvous.control import JobControl, wait_for_key
from ftrun.rendezvous.ranks import NodeDescriptor, Round, order_nodes, row_from_json

log = logging.getLogger("ftrun.rendezvous")

BACKEND = "ftrun-barrier"
_WAIT_CHUNK_S = 1.0  # how often a waiting node looks at shutdown requests and its signals


class JoinInterruptedError(Exception):
    """The agent asked to stop waiting (a signal arrived)."""


class BarrierRendezvousHandler(RendezvousHandler):
    """torch's RendezvousHandler on the barrier algorithm; `join` is what the agent calls."""

    def __init__(
        self,
        config: RendezvousConfig,
        store: Store,
        descriptor: Callable[[], NodeDescriptor],
    ) -> None:
        self._config = config
        self._prefix = f"ftrun/{config.run_id}"
        self._store = store
        self.control = JobControl(store, self._prefix)
        self._descriptor = descriptor

    # ---- torch's RendezvousHandler -------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        rnd = self.join(lambda: False)
        return RendezvousInfo(
            store=PrefixStore(f"{self._prefix}/c{rnd.number}/workers", self._store),
            rank=rnd.group_rank,
            world_size=len(rnd.nodes),
            bootstrap_store_info=RendezvousStoreInfo(rnd.master.host, rnd.master.master_port),
        )

    def is_closed(self) -> bool:
        return self.control.shutdown_requested() is not None

    def set_closed(self) -> None:
        self.control.shutdown(ExitCode.SUCCESS, "rendezvous closed", self.control.cycle())

    def num_nodes_waiting(self) -> int:
        """Nodes that arrived after the current round closed (candidates for a scale-up)."""
        cycle = self.control.cycle()
        closed = self._key(cycle, "closed")
        if not self._store.check([closed]):
            return 0
        size = int(self._store.get(closed))
        return max(0, self._store.add(self._key(cycle, "arrivals"), 0) - size)

    def get_run_id(self) -> str:
        return self._config.run_id

    def shutdown(self) -> bool:
        return True

    # ---- the algorithm ---------------------------------------------------------------------

    def join(self, interrupted: Callable[[], bool]) -> Round:
        """Take part in the current round (or the next, if late); raises on timeout/shutdown."""
        deadline = time.monotonic() + self._config.join_timeout
        while True:
            self._raise_if_shut_down()
            cycle = self.control.cycle()
            index = self._store.add(self._key(cycle, "arrivals"), 1) - 1
            if index < self._config.max_nodes:
                self._store.set(self._key(cycle, f"node/{index}"), self._descriptor().to_json())
            if index + 1 == self._config.max_nodes:
                self._close(cycle, self._config.max_nodes)
            size = self._await_close(cycle, deadline, interrupted)
            if index < size:
                return self._finish(cycle, index, size)
            log.info("round %d closed without this node; waiting for the next", cycle)
            self._await_next(cycle, deadline, interrupted)

    def _finish(self, cycle: int, index: int, size: int) -> Round:
        published = zlib.decompress(self._store.get(self._key(cycle, f"round/{size}")))
        arrivals = NodeDescriptor.from_rows(json.loads(published))
        nodes = order_nodes(arrivals, self._config.use_infra_group_rank)
        me = arrivals[index]
        return Round(cycle, nodes, nodes.index(me))

    def _await_close(self, cycle: int, deadline: float, interrupted: Callable[[], bool]) -> int:
        closed = self._key(cycle, "closed")
        min_reached_at: float | None = None
        while not wait_for_key(self._store, closed, _WAIT_CHUNK_S):
            self._check_waiting(deadline, interrupted)
            possible = self.control.healthy_capacity(
                cycle, self._config.min_nodes, self._config.max_nodes
            )
            arrived = self._store.add(self._key(cycle, "arrivals"), 0)
            now = time.monotonic()
            if arrived >= self._config.min_nodes:
                min_reached_at = min_reached_at or now
                if arrived >= possible or now - min_reached_at >= self._config.last_call_timeout:
                    self._close(cycle, min(arrived, self._config.max_nodes))
        return int(self._store.get(closed))

    def _await_next(self, cycle: int, deadline: float, interrupted: Callable[[], bool]) -> None:
        while not self.control.wait_restart(cycle, _WAIT_CHUNK_S):
            self._check_waiting(deadline, interrupted)

    def _check_waiting(self, deadline: float, interrupted: Callable[[], bool]) -> None:
        if interrupted():
            raise JoinInterruptedError
        self._raise_if_shut_down()
        if time.monotonic() >= deadline:
            raise RendezvousTimeoutError(
                f"rendezvous did not complete within join_timeout={self._config.join_timeout}s "
                f"(need {self._config.min_nodes} node(s))"
            )

    def _raise_if_shut_down(self) -> None:
        shutdown = self.control.shutdown_requested()
        if shutdown is not None:
            raise RendezvousClosedError(shutdown.reason)

    def _close(self, cycle: int, size: int) -> None:
        """Publish the round's descriptors, then close it (a losing closer's blob is unused)."""
        keys = [self._key(cycle, f"node/{i}") for i in range(size)]
        # Foreign-version descriptors are published too: every participant then refuses them.
        rows = [row_from_json(raw) for raw in self._store.multi_get(keys)]
        blob = zlib.compress(json.dumps(rows).encode(), 1)
        self._store.set(self._key(cycle, f"round/{size}"), blob)
        self._store.compare_set(self._key(cycle, "closed"), "", str(size))

    def _key(self, cycle: int, name: str) -> str:
        return f"{self._prefix}/c{cycle}/{name}"
