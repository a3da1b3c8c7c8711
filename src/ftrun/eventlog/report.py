"""The job's story from its events: lanes of states per node, cycles, failures and their cost.

All times across nodes use the wall clock `ts` (nodes' monotonic clocks are unrelated); spans
inside one node start at `ts - duration` of the event that ends them, the only start the
launcher records. Every number a person or a machine reads comes from here, never from the
renderers, so the text, the JSON and the picture cannot disagree.

Training is measured on progress, not processes: a cycle trains from the moment every rank of
the job has stepped (`stepping` events, from the rank monitor) to its last progress. Start-up
(launch to the first stepping) and recovery (a failure to stepping again) count as lost, and so
does work redone after a restart where the ranks report their iteration. Without any `stepping`
event (no RankMonitorClient in the workers) the report falls back to process times, and says
so (`progress_reported` False).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ftrun.errors import ExitCode
from ftrun.eventlog.attribution import Attribution, RerunVerdict, attribute, rerun_verdicts
from ftrun.eventlog.failures import CycleTimes, Failure, find_failures
from ftrun.eventlog.inprocess import InprocessRestart, inprocess_restarts
from ftrun.eventlog.lanes import FINISHED, RENDEZVOUS, Lane, Span
from ftrun.eventlog.reader import Event, EventSet, ints
from ftrun.eventlog.startup import StartupSplit, startup_splits


@dataclasses.dataclass(frozen=True)
class Cycle:
    number: int
    nodes: tuple[str, ...]
    world_size: int | None
    start: float
    rendezvous_s: float
    running_at: float | None
    """Every node's workers were started (process time)."""
    stepping_at: float | None
    """Every rank of the job had stepped (None: never, or no progress reported)."""
    training_until: float | None
    """The end of the cycle's progress: its last progress before a failure, else its end."""
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
    exit_why: str | None
    unhealthy: str | None  # why its health check failed; it left the job then
    unhealthy_at: float | None
    last_ts: float
    standby_cycles: tuple[int, ...] = ()
    """Cycles it stood by in as a hot spare (arrived, not in the round)."""


@dataclasses.dataclass(frozen=True)
class Report:
    log_dir: str
    outcome: str
    start: float
    end: float
    wall_s: float
    progress_reported: bool
    """False: no rank reported progress (no RankMonitorClient); times are process times."""
    running_s: float
    """Seconds with every worker of a cycle running (process time)."""
    effective_s: float
    """Seconds of training that the job kept: stepping, not lost to a failure nor redone."""
    effective_ratio: float
    """effective_s / wall_s: the effective training time ratio (ETTR)."""
    startup_s: float | None
    """Launch to every rank stepping for the first time (None: never, or not reported)."""
    redone_s: float
    """Estimated seconds of work done again after restarts (iterations reported only)."""
    nodes: tuple[NodeInfo, ...]
    cycles: tuple[Cycle, ...]
    failures: tuple[Failure, ...]
    attributions: tuple[Attribution, ...]
    """Per failed cycle: its signature, the suspect, the evidence, the policy's decision."""
    reruns: tuple[RerunVerdict, ...]
    """The re-run state machine's verdicts."""
    inprocess: tuple[InprocessRestart, ...]
    """Faults the wrapped ranks recovered without a launcher cycle (`ftrun.inprocess`)."""
    spans: tuple[Span, ...]
    startup: tuple[StartupSplit, ...]
    """Per cycle, where its slowest rank's start-up went (`rank_startup` events)."""
    warnings: tuple[str, ...]


def build_report(events: EventSet, now: float | None = None) -> Report:
    """Everything the renderers show, computed once from the parsed events. `now`: the job is
    still running (the live view): its last states last until `now`, and so does its wall time."""
    all_events = sorted((e for evs in events.nodes.values() for e in evs), key=lambda e: e.ts)
    by_progress = any(e.event == "stepping" for e in all_events)
    end = max(all_events[-1].ts, now or 0.0)
    until = end if now is not None else None
    spans = tuple(
        s for node, evs in events.nodes.items() for s in Lane(node, by_progress).build(evs, until)
    )
    start = min([s.start for s in spans] + [all_events[0].ts])
    infos = (_node_info(node, evs) for node, evs in events.nodes.items())
    nodes = tuple(sorted(infos, key=lambda n: node_order(n.group_rank, n.name)))
    cycle_numbers = sorted({e.cycle for e in all_events if e.event == "rendezvous_done"})
    times = {c: _cycle_times(all_events, c) for c in cycle_numbers}
    failures = find_failures(all_events, cycle_numbers, times, end, by_progress)
    cycles = tuple(
        _cycle(c, all_events, spans, times[c], failures, cycle_numbers, nodes)
        for c in cycle_numbers
    )
    running_s = sum(max(c.end - c.running_at, 0.0) for c in cycles if c.running_at is not None)
    redone_s = sum(f.redone_s or 0.0 for f in failures)
    if by_progress:
        effective_s = max(_training_time(cycles) - redone_s, 0.0)
    else:
        effective_s = _process_training_time(cycles, failures)
    stepped = [c.stepping_at for c in cycles if c.stepping_at is not None]
    wall_s = max(end - start, 0.0)
    return Report(
        log_dir=str(events.log_dir),
        outcome=_outcome(nodes),
        start=start,
        end=end,
        wall_s=wall_s,
        progress_reported=by_progress,
        running_s=running_s,
        effective_s=effective_s,
        effective_ratio=effective_s / wall_s if wall_s > 0 else 0.0,
        startup_s=stepped[0] - start if stepped else None,
        redone_s=redone_s,
        nodes=nodes,
        cycles=cycles,
        failures=failures,
        attributions=attribute(all_events),
        reruns=rerun_verdicts(all_events),
        inprocess=inprocess_restarts(all_events),
        spans=spans,
        startup=startup_splits(all_events),
        warnings=events.warnings,
    )


def _node_info(node: str, events: Sequence[Event]) -> NodeInfo:
    rdzv = [e for e in events if e.event == "rendezvous_done"]
    started = [e for e in events if e.event == "workers_started"]
    exits = [e for e in events if e.event == "exit"]
    sick = [e for e in events if e.event == "unhealthy"]
    standby = tuple(e.cycle for e in events if e.event == "standby")
    return NodeInfo(
        name=node,
        group_rank=rdzv[-1].get("group_rank") if rdzv else None,
        ranks=tuple(started[-1].get("ranks", ())) if started else (),
        store_host=any(e.get("store_host") is True for e in rdzv),
        exit_code=exits[-1].get("code") if exits else None,
        exit_reason=exits[-1].get("reason") if exits else None,
        exit_why=exits[-1].get("why") if exits else None,
        unhealthy=sick[-1].get("reason") if sick else None,
        unhealthy_at=sick[-1].ts if sick else None,
        last_ts=events[-1].ts,
        standby_cycles=standby,
    )


def node_order(group_rank: int | None, name: str) -> tuple[bool, int, str]:
    """Nodes by group rank (those without one last), then by name."""
    return group_rank is None, group_rank or 0, name


def _outcome(nodes: Iterable[NodeInfo]) -> str:
    """The job's verdict: the worst node's, and INCOMPLETE when a node never said goodbye."""
    codes = [n.exit_code for n in nodes]
    left = (None, ExitCode.EXCLUDED, ExitCode.DO_NOT_RELAUNCH)  # lost, excluded, unhealthy
    if ExitCode.SUCCESS in codes and all(code in (ExitCode.SUCCESS, *left) for code in codes):
        return "SUCCESS"  # a launcher exits 0 only once the job's workers all finished
    if any(code is None for code in codes):
        return "INCOMPLETE"
    # A node excluded at a worker's request left; the job's verdict is the others'.
    failed = [code for code in codes if code not in (ExitCode.SUCCESS, ExitCode.EXCLUDED)]
    if not failed:
        return "SUCCESS"
    code = failed[0]
    return ExitCode(code).name if code in ExitCode._value2member_map_ else f"EXIT {code}"


def _cycle_times(events: Sequence[Event], cycle: int) -> CycleTimes:
    """When the cycle's workers ran on every node, when every rank stepped, and its last
    progress and iterations; a moment "on every node" is None if a node never got there."""
    formed = next(e for e in events if e.event == "rendezvous_done" and e.cycle == cycle)
    nodes = set(formed.get("nodes", ()))
    mine = [e for e in events if e.cycle == cycle]
    starts = {e.node: e.ts for e in mine if e.event == "workers_started"}
    stepping = {e.node: e for e in mine if e.event == "stepping"}
    last = [e for e in mine if e.event == "last_progress"]
    progress = [t for e in last if (t := e.num("progress_ts", None)) is not None]
    firsts = [i for e in stepping.values() for i in ints(e.get("iterations"))]
    lasts = [i for e in last for i in ints(e.get("iterations"))]
    all_stepped = bool(stepping) and nodes <= set(stepping)
    return CycleTimes(
        running_at=max(starts.values()) if starts and nodes <= set(starts) else None,
        stepping_at=max(e.num("progress_ts") for e in stepping.values()) if all_stepped else None,
        last_progress=max(progress) if progress else None,
        first_iteration=min(firsts) if firsts else None,
        last_iteration=max(lasts) if lasts else None,
    )


def _cycle(
    number: int,
    events: Sequence[Event],
    spans: Sequence[Span],
    times: CycleTimes,
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
    training_until: float | None = None
    if times.stepping_at is not None:
        if failure is not None:
            training_until = failure.last_healthy
        elif times.last_progress is not None:
            training_until = min(max(times.last_progress, times.stepping_at), end)
        else:
            training_until = end
    return Cycle(
        number=number,
        nodes=tuple(formed[0].get("nodes", ())),
        world_size=world if isinstance(world, int) else None,
        start=min([s.start for s in mine if s.state == RENDEZVOUS] + [formed[0].ts]),
        rendezvous_s=max(e.num("duration") for e in formed),
        running_at=times.running_at,
        stepping_at=times.stepping_at,
        training_until=training_until,
        end=end,
        stop_s=max(e.num("duration") for e in stops) if stops else None,
        killed=sum(k for k in killed if isinstance(k, int)),
        outcome=outcome,
        ended=ended,
        failure=failure.number if failure else None,
    )


def _training_time(cycles: Sequence[Cycle]) -> float:
    """Seconds during which the job made progress: every rank stepping, up to the last
    progress before each failure."""
    return sum(
        max(c.training_until - c.stepping_at, 0.0)
        for c in cycles
        if c.stepping_at is not None and c.training_until is not None
    )


def _process_training_time(cycles: Sequence[Cycle], failures: Sequence[Failure]) -> float:
    """Without a progress report: seconds with every worker running, less what a failure lost
    (a hung job's last `waited` seconds). Start-up inside the workers and work redone are
    invisible here, so they count as effective: the report labels this as process time."""
    effective = 0.0
    by_number = {f.number: f for f in failures}
    for cycle in cycles:
        if cycle.running_at is None:
            continue
        useful_until = cycle.end
        if cycle.failure is not None:
            useful_until = min(useful_until, by_number[cycle.failure].last_healthy)
        effective += max(useful_until - cycle.running_at, 0.0)
    return effective


def duration_text(seconds: float) -> str:
    """Seconds as people read them: 4.20s, 3m05s, 2h01m05s."""
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s"
