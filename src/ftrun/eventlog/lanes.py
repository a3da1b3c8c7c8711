"""Each node's lane: its events read back into spans of states (rendezvous, starting, running,
stalled, stopping, finished), the agent's state machine read backwards. `report` builds the
job's story on them; `tools/timeline` draws them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ftrun.eventlog.reader import Event

RENDEZVOUS, STARTING, RUNNING = "rendezvous", "starting", "running"
STALLED, STOPPING, FINISHED = "stalled", "stopping", "finished"
"""Lane states. STARTING: workers up, not every local rank has stepped yet; RUNNING: stepping
(without a progress report: workers up); STALLED: after the last progress, until stopped."""


@dataclasses.dataclass(frozen=True)
class Span:
    """One node in one state, from `start` to `end` (wall clock); `cycle` None: never formed."""

    node: str
    state: str
    start: float
    end: float
    cycle: int | None


class Lane:
    """Turns one node's events into state spans; the agent's state machine, read backwards."""

    def __init__(self, node: str, by_progress: bool) -> None:
        self.node = node
        self.by_progress = by_progress
        self.spans: list[Span] = []
        self.state: str | None = None
        self.since = 0.0
        self.cycle: int | None = None
        self.unfinished: set[int] = set()

    def build(self, events: Sequence[Event], until: float | None = None) -> list[Span]:
        """`until`: the last state lasts until then (a running job), not its last event."""
        for event in events:
            self._step(event)
        self._switch(None, until if until is not None else events[-1].ts, None)
        return self.spans

    def _step(self, event: Event) -> None:
        kind = event.event
        if kind == "health_check":  # the check runs right before the rendezvous: one bar
            self._switch(RENDEZVOUS, event.ts - event.num("duration"), None)
        elif kind == "rendezvous_done":
            if self.state != RENDEZVOUS:  # its health_check line was lost or malformed
                self._switch(RENDEZVOUS, event.ts - event.num("duration"), None)
            self.cycle = event.cycle  # known only now: the bar belongs to the cycle it forms
        elif kind == "standby":  # a hot spare idles until a later round takes it in
            self._switch(None, event.ts, None)
        elif kind == "workers_started":
            self._switch(STARTING if self.by_progress else RUNNING, event.ts, event.cycle)
            self.unfinished = set(event.get("ranks", []))
        elif kind == "stepping" and self.state == STARTING:
            self._switch(RUNNING, event.num("progress_ts", event.ts), event.cycle)
        elif kind == "last_progress" and event.get("before") == "stop" and self.state == RUNNING:
            if (last := event.num("progress_ts", None)) is not None:
                self._switch(STALLED, min(last, event.ts), event.cycle)
        elif kind == "worker_exited" and event.get("code") == 0 and self.state in _WORKING:
            self.unfinished.discard(event.get("rank"))
            if not self.unfinished:  # done, waiting for the other nodes to finish too
                self._switch(FINISHED, event.ts, event.cycle)
        elif kind in ("stop_done", "gpu_memory_reclaimed"):  # waiting for GPU memory: stopping
            self._switch(STOPPING, event.ts - event.num("duration"), event.cycle)
            self._switch(None, event.ts, None)
        elif kind == "exit":
            self._switch(None, event.ts, None)

    def _switch(self, state: str | None, at: float, cycle: int | None) -> None:
        if self.state is not None:
            self.spans.append(
                Span(self.node, self.state, self.since, max(at, self.since), self.cycle)
            )
        self.state, self.since, self.cycle = state, max(at, self.since), cycle


_WORKING = (STARTING, RUNNING, STALLED)
