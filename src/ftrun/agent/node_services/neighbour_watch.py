"""Learning, while the workers run, that the next node of the round is gone.

A node lost with its workers (its host powered off, its launcher's process group killed) tells
no one. Over gloo, the survivors' next collective fails on the closed socket and their workers
exit; over NCCL on NVLink or shared memory, it waits for the dead peer until torch's collective
timeout (10 minutes by default), and nothing restarts the job in between. So each agent asks its
ring neighbour (group rank + 1, wrapping) whether it still answers on its peer channel
(`PeerService.answers`): one small request a second on a connection that stays open, no store
request, the same for every job size. A dead agent's port refuses at once, a dead host's probe
times out; `MISSES_IN_A_ROW` failed probes put a `NeighbourLost` on the agent's inbox, and the
policy ends the cycle as for any other failure (the spare, if one waits, takes the slot).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable

from ftrun.rendezvous.barrier import Probe
from ftrun.rendezvous.ranks import NodeDescriptor, Round
from ftrun.services import NodeService, Post

log = logging.getLogger("ftrun.agent")

PROBE_INTERVAL_S = 1.0
"""Between two probes of the neighbour."""
MISSES_IN_A_ROW = 3
"""Failed probes in a row that make the neighbour lost: a refused port fails a probe at once
(lost within about 3 s), a host that does not answer within the probe's 2 s timeout about three
times that; one slow answer under load is not a loss."""


@dataclasses.dataclass(frozen=True)
class NeighbourLost:
    """The next node of `cycle`'s round stopped answering (an inbox item)."""

    cycle: int
    node: str


class NeighbourWatch(NodeService):
    name = "neighbour-watch"

    def __init__(self, answers: Probe, post: Post, interval_s: float = PROBE_INTERVAL_S) -> None:
        """`answers`: whether a node's agent answers on its peer channel; `post`: the inbox."""
        self._answers, self._post, self._interval_s = answers, post, interval_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []  # every cycle's: an old one may be ending

    @staticmethod
    def neighbour(rnd: Round) -> NodeDescriptor | None:
        """The node this one watches: the next by group rank; None alone or without a channel."""
        if len(rnd.nodes) < 2:
            return None
        after = rnd.nodes[(rnd.group_rank + 1) % len(rnd.nodes)]
        return after if after.peer_port and rnd.me.peer_port else None

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        self._stop.set()
        watched = self.neighbour(rnd)
        if watched is None:
            return
        self._stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(rnd.number, watched, self._stop),
                                  daemon=True, name=f"neighbour-watch-c{rnd.number}")  # fmt: skip
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._stop.set()

    def on_finished(self, rnd: Round) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + self._interval_s + 5.0  # a probe's own timeout bounds it
        for thread in self._threads:  # a stopped cycle's too: it may still be in its probe
            thread.join(max(0.0, deadline - time.monotonic()))

    def _watch(self, cycle: int, watched: NodeDescriptor, stop: threading.Event) -> None:
        missed = 0
        while not stop.wait(self._interval_s):
            missed = 0 if self._answers(watched) else missed + 1
            if missed >= MISSES_IN_A_ROW and not stop.is_set():
                log.warning("cycle %d: node %s (%s:%d) did not answer %d probes in a row", cycle,
                            watched.node, watched.host, watched.peer_port, missed)  # fmt: skip
                self._post(NeighbourLost(cycle, watched.node))
                return
