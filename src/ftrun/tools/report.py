"""The job's story from its events: lanes of states per node, cycles, failures and their cost.

All times across nodes use the wall clock `ts` (nodes' monotonic clocks are unrelated); spans
inside one node start at `ts - duration` of the event that ends them, the only start the
launcher records. Every number a person or a machine reads comes from here, never from the
renderers, so the text, the JSON and the picture cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ftrun.errors import ExitCode
from ftrun.tools.events import Event, EventSet
from ftrun.tools.failures import Failure, find_failures

RENDEZVOUS, RUNNING, STOPPING, FINISHED = "rendezvous", "running", "stopping", "finished"


@dataclasses.dataclass(frozen=True)
class Span:
    """One node in one state, from `start` to `end` (wall clock); `cycle` None: never formed."""

    node: str
    state: str
    start: float
    end: float
    cycle: int | None


@dataclasses.dataclass(frozen=True)
class Cycle:
    number: int
    nodes: tuple[str, ...]
    world_size: int | None
    start: float
    rendezvous_s: float
    running_at: float | None
    end: float
    stop_s: float | None  # the slowest node's stop; None: the workers were not stopped
    killed: int  # workers that ignored the termination signal and were SIGKILLed
    outcome: str
    ended: str
    failure: int | None


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    group_rank: int | None
    ranks: tuple[int, ...]
    store_host: bool
    exit_code: int | None
    exit_reason: str | None
    unhealthy: str | None  # why its health check failed; it left the job then
    unhealthy_at: float | None
    last_ts: float


@dataclasses.dataclass(frozen=True)
class Report:
    log_dir: str
    outcome: str
    start: float
    end: float
    wall_s: float
    running_s: float
    effective_s: float
    effective_ratio: float
    nodes: tuple[NodeInfo, ...]
    cycles: tuple[Cycle, ...]
    failures: tuple[Failure, ...]
    spans: tuple[Span, ...]
    warnings: tuple[str, ...]


def build_report(events: EventSet) -> Report:
    """Everything the renderers show, computed once from the parsed events."""
    all_events = sorted((e for evs in events.nodes.values() for e in evs), key=lambda e: e.ts)
    spans = tuple(s for node, evs in events.nodes.items() for s in _Lane(node).build(evs))
    start = min([s.start for s in spans] + [all_events[0].ts])
    end = all_events[-1].ts
    nodes = tuple(
        sorted(
            (_node_info(node, evs) for node, evs in events.nodes.items()),
            key=lambda n: (n.group_rank is None, n.group_rank or 0, n.name),  # rank order
        )
    )
    cycle_numbers = sorted({e.cycle for e in all_events if e.event == "rendezvous_done"})
    running_at = {c: _running_at(all_events, c) for c in cycle_numbers}
    failures = find_failures(all_events, cycle_numbers, running_at, end)
    cycles = tuple(
        _cycle(c, all_events, spans, running_at[c], failures, cycle_numbers, nodes)
        for c in cycle_numbers
    )
    running_s, effective_s = _training_time(cycles, failures)
    wall_s = max(end - start, 0.0)
    return Report(
        log_dir=str(events.log_dir),
        outcome=_outcome(nodes),
        start=start,
        end=end,
        wall_s=wall_s,
        running_s=running_s,
        effective_s=effective_s,
        effective_ratio=effective_s / wall_s if wall_s > 0 else 0.0,
        nodes=nodes,
        cycles=cycles,
        failures=failures,
        spans=spans,
        warnings=events.warnings,
    )


class _Lane:
    """Turns one node's events into state spans; the agent's state machine, read backwards."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.spans: list[Span] = []
        self.state: str | None = None
        self.since = 0.0
        self.cycle: int | None = None
        self.unfinished: set[int] = set()

    def build(self, events: Sequence[Event]) -> list[Span]:
        for event in events:
            self._step(event)
        self._switch(None, events[-1].ts, None)
        return self.spans

    def _step(self, event: Event) -> None:
        kind = event.event
        if kind == "health_check":  # the check runs right before the rendezvous: one bar
            self._switch(RENDEZVOUS, event.ts - event.num("duration"), None)
        elif kind == "rendezvous_done":
            if self.state != RENDEZVOUS:  # its health_check line was lost or malformed
                self._switch(RENDEZVOUS, event.ts - event.num("duration"), None)
            self.cycle = event.cycle  # known only now: the bar belongs to the cycle it forms
        elif kind == "workers_started":
            self._switch(RUNNING, event.ts, event.cycle)
            self.unfinished = set(event.get("ranks", []))
        elif kind == "worker_exited" and event.get("code") == 0 and self.state == RUNNING:
            self.unfinished.discard(event.get("rank"))
            if not self.unfinished:  # done, waiting for the other nodes to finish too
                self._switch(FINISHED, event.ts, event.cycle)
        elif kind in ("stop_done", "gpu_memory_reclaimed"):  # waiting for GPU memory: stopping
            began = event.ts - event.num("duration")
            self._switch(STOPPING, began, event.cycle)
            self._switch(None, event.ts, None)
        elif kind == "exit":
            self._switch(None, event.ts, None)

    def _switch(self, state: str | None, at: float, cycle: int | None) -> None:
        if self.state is not None:
            self.spans.append(
                Span(self.node, self.state, self.since, max(at, self.since), self.cycle)
            )
        self.state, self.since, self.cycle = state, max(at, self.since), cycle


def _node_info(node: str, events: Sequence[Event]) -> NodeInfo:
    rdzv = [e for e in events if e.event == "rendezvous_done"]
    started = [e for e in events if e.event == "workers_started"]
    exits = [e for e in events if e.event == "exit"]
    sick = [e for e in events if e.event == "unhealthy"]
    return NodeInfo(
        name=node,
        group_rank=rdzv[-1].get("group_rank") if rdzv else None,
        ranks=tuple(started[-1].get("ranks", ())) if started else (),
        store_host=any(e.get("store_host") is True for e in rdzv),
        exit_code=exits[-1].get("code") if exits else None,
        exit_reason=exits[-1].get("reason") if exits else None,
        unhealthy=sick[-1].get("reason") if sick else None,
        unhealthy_at=sick[-1].ts if sick else None,
        last_ts=events[-1].ts,
    )


def _outcome(nodes: Iterable[NodeInfo]) -> str:
    """The job's verdict: the worst node's, and INCOMPLETE when a node never said goodbye."""
    codes = [n.exit_code for n in nodes]
    if any(code is None for code in codes):
        return "INCOMPLETE"
    failed = [code for code in codes if code != 0]
    if not failed:
        return "SUCCESS"
    code = failed[0]
    return ExitCode(code).name if code in ExitCode._value2member_map_ else f"EXIT {code}"


def _running_at(events: Sequence[Event], cycle: int) -> float | None:
    """When the cycle's workers ran on every node (the last start), None if they never did."""
    formed = next(e for e in events if e.event == "rendezvous_done" and e.cycle == cycle)
    starts = [e.ts for e in events if e.event == "workers_started" and e.cycle == cycle]
    if len(starts) < len(formed.get("nodes", ())):
        return None
    return max(starts) if starts else None


def _cycle(
    number: int,
    events: Sequence[Event],
    spans: Sequence[Span],
    running_at: float | None,
    failures: Sequence[Failure],
    cycle_numbers: Sequence[int],
    nodes: Sequence[NodeInfo],
) -> Cycle:
    formed = [e for e in events if e.event == "rendezvous_done" and e.cycle == number]
    mine = [s for s in spans if s.cycle == number]
    failure = next((f for f in failures if f.cycle == number), None)
    done = [s.start for s in mine if s.state == FINISHED]
    last = number == cycle_numbers[-1]
    if failure is not None:
        then = "restart" if failure.recovered_at is not None or not last else "job ended"
        ended = f"{failure.kind} (failure #{failure.number}) -> {then}"
        outcome, end = "failed", failure.ts
    elif done and len(done) == len(formed[0].get("nodes", ())):
        outcome, ended, end = "succeeded", "all workers finished", max(done)
    else:
        outcome, end = "ended", max([s.end for s in mine] + [formed[-1].ts])
        ended = f"job ended: {_outcome(nodes)}"
    world = formed[0].get("world_size")
    stops = [e for e in events if e.event == "stop_done" and e.cycle == number]
    killed = [e.get("killed") for e in stops]
    return Cycle(
        number=number,
        nodes=tuple(formed[0].get("nodes", ())),
        world_size=world if isinstance(world, int) else None,
        start=min([s.start for s in mine if s.state == RENDEZVOUS] + [formed[0].ts]),
        rendezvous_s=max(e.num("duration") for e in formed),
        running_at=running_at,
        end=end,
        stop_s=max(e.num("duration") for e in stops) if stops else None,
        killed=sum(k for k in killed if isinstance(k, int)),
        outcome=outcome,
        ended=ended,
        failure=failure.number if failure else None,
    )


def _training_time(cycles: Sequence[Cycle], failures: Sequence[Failure]) -> tuple[float, float]:
    """Seconds with every worker running, and the part of it not lost to a failure: a hung
    job's last `waited` seconds made no progress. (Work redone after resuming from the last
    checkpoint is invisible in the events, so it counts as effective.)"""
    running = effective = 0.0
    by_number = {f.number: f for f in failures}
    for cycle in cycles:
        if cycle.running_at is None:
            continue
        running += max(cycle.end - cycle.running_at, 0.0)
        useful_until = cycle.end
        if cycle.failure is not None:
            useful_until = min(useful_until, by_number[cycle.failure].last_healthy)
        effective += max(useful_until - cycle.running_at, 0.0)
    return running, effective
