"""Failures: what ended each cycle, which ranks and nodes, and what it cost.

A failed cycle usually leaves several failure events: the cause, then its consequences (peers
that crash on a closed socket, every rank blocked behind a hung one). The first event by wall
clock is the cause; a cycle's hangs are one incident because the monitor flags all the blocked
ranks in the same window. Costs: detection (a crash is seen at once, a hang after `waited`),
recovery (failure to every rank of the job stepping again) and time lost (the last progress
before the failure to stepping again), plus, where ranks report their iteration, the
iterations redone after resuming from an older checkpoint.

Progress comes from the rank monitor (`stepping` and `last_progress` events). A job without a
RankMonitorClient reports none: its costs are measured on processes instead (recovery to every
worker started again), which the report says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ftrun.eventlog.attribution import Culprit, hang_culprit, lost_nodes
from ftrun.eventlog.reader import Event

CRASH, HANG, SIGNAL, STORE_LOST, RESTART = "crash", "hang", "signal", "store lost", "restart"
NODE_LOST, HEALTH, STORE_RESTARTED = "node lost", "health", "store restarted"
_FAILURE_EVENTS = ("worker_exited", "hang", "signal", "store_lost", "store_restarted")
_HANG_TEXT = {
    "no first heartbeat": "no first heartbeat",
    "heartbeat": "no heartbeat",
    "out of section": "stuck outside any section",
}


@dataclasses.dataclass(frozen=True)
class HangInfo:
    kind: str
    section: str | None
    timeout: float | None
    waited: float
    detection_latency: float | None
    stack_files: tuple[str, ...]
    where: tuple[str, ...] = ()
    """Where the hung ranks were, one line per place; a rank stuck in its own code while the
    others wait inside libraries is marked as the likely cause."""


@dataclasses.dataclass(frozen=True)
class CycleTimes:
    """The moments of one cycle that failures are measured between (wall clock)."""

    running_at: float | None = None
    """Every node's workers were started (process time); None: never."""
    stepping_at: float | None = None
    """Every rank of the job showed progress; None: never, or no progress reported."""
    last_progress: float | None = None
    """The latest progress of any rank before the workers were stopped (or finished)."""
    first_iteration: int | None = None
    """The lowest iteration the ranks reported with their first progress."""
    last_iteration: int | None = None
    """The highest iteration the ranks reported before the stop."""

    def start(self, by_progress: bool) -> float | None:
        """When the cycle was training: every rank stepping, or (no progress) every worker up."""
        return self.stepping_at if by_progress else self.running_at


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failure:
    """What ended a cycle, where, and what it cost. `kind` "restart": no failure event at all."""

    number: int
    cycle: int
    kind: str
    ts: float
    nodes: tuple[str, ...]
    ranks: tuple[int, ...] = ()
    cause: str
    exit_code: int | None = None
    signal: str | None = None
    hang: HangInfo | None = None
    detection_s: float
    last_healthy: float
    """The last progress before the failure (process mode: its estimate)."""
    recovered_at: float | None
    """Every rank stepping again (process mode: every worker started again); None: never."""
    recovery_s: float | None
    lost_s: float
    secondary: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    redone_iterations: int | None = None
    """Iterations done again after the restart (None: the ranks report no iterations)."""
    redone_s: float | None = None
    """Their estimated time, at the failed cycle's pace."""


def _is_failure(event: Event) -> bool:
    if event.event == "worker_exited":
        return event.get("code") != 0
    if event.event == "failure":  # a health fault the policy acted on has no other event
        return event.get("kind") == HEALTH
    return event.event in _FAILURE_EVENTS


def find_failures(
    events: Sequence[Event],
    cycles: Sequence[int],
    times: Mapping[int, CycleTimes],
    job_end: float,
    by_progress: bool,
) -> tuple[Failure, ...]:
    """One failure per cycle that did not end the job cleanly, numbered from 1; measured on
    training progress when `by_progress`, else on processes."""
    failures: list[Failure] = []
    for i, cycle in enumerate(cycles):
        in_cycle = [e for e in events if e.cycle == cycle and _is_failure(e)]
        if not in_cycle and i + 1 == len(cycles):
            continue  # the last cycle ended without a failure: success or a clean exit
        later = [times[c] for c in cycles[i + 1 :] if times[c].start(by_progress) is not None]
        timing = _Timing(times[cycle], later[0] if later else None, job_end, by_progress)
        number = len(failures) + 1
        lost = lost_nodes(events, cycle)
        if in_cycle:
            failure = _from_events(number, cycle, _causes_first(in_cycle, events), events, timing)
            if lost:
                failure = _node_lost(failure, lost)
        else:
            failure = _restart_without_failure(number, cycle, events, timing)
        failures.append(failure)
    return tuple(failures)


@dataclasses.dataclass(frozen=True)
class _Timing:
    """The moments a failure's costs are measured between."""

    failed: CycleTimes
    recovery_cycle: CycleTimes | None  # the first later cycle that trained (None: none did)
    job_end: float
    by_progress: bool

    def last_healthy(self, failed_at: float, detection: float) -> float:
        """The last progress before the failure, never after it (ranks that went on alone made
        no progress the job keeps). Without a progress report: a hang stopped progress
        `detection` seconds before the verdict. Never before the cycle trained: a verdict on
        left-over workers must not reach back further, and a cycle that never trained lost
        nothing of its own (the failure before it is still being paid for)."""
        start = self.failed.start(self.by_progress)
        if start is None:
            return failed_at
        if self.by_progress and self.failed.last_progress is not None:
            return min(max(self.failed.last_progress, start), failed_at)
        return min(max(failed_at - detection, start), failed_at)

    def costs(self, failed_at: float, detection: float) -> dict[str, Any]:
        """A failure's cost fields of `Failure`: it happened at `failed_at` and was seen
        `detection` seconds after progress stopped."""
        last_healthy = self.last_healthy(failed_at, detection)
        again = self.recovery_cycle
        back = None if again is None else again.start(self.by_progress)
        redone, redone_s = self.redone(last_healthy)
        return {
            "detection_s": detection,
            "last_healthy": last_healthy,
            "recovered_at": back,
            "recovery_s": None if back is None else max(back - failed_at, 0.0),
            "lost_s": max((self.job_end if back is None else back) - last_healthy, 0.0),
            "redone_iterations": redone,
            "redone_s": redone_s,
        }

    def redone(self, last_healthy: float) -> tuple[int | None, float | None]:
        """Iterations redone after the restart, and their time at the failed cycle's pace
        (its iterations from stepping to `last_healthy`): from the last iteration before the
        stop back to the first one after the restart."""
        failed, again = self.failed, self.recovery_cycle
        if not self.by_progress or again is None:
            return None, None
        if failed.last_iteration is None or again.first_iteration is None:
            return None, None
        count = max(failed.last_iteration - again.first_iteration + 1, 0)
        first = failed.first_iteration
        done = failed.last_iteration - first if first is not None else 0
        if failed.stepping_at is None or done <= 0:
            return count, None
        pace = max(last_healthy - failed.stepping_at, 0.0) / done
        return count, count * pace


def _from_events(
    number: int, cycle: int, in_cycle: Sequence[Event], events: Sequence[Event], timing: _Timing
) -> Failure:
    """The first failure event is the cause; hangs of one cycle are one incident (the monitor
    flags every rank blocked behind the culprit at once: the flight recorders, or a stopped
    process, name the culprit among them); later events are consequences."""
    first = in_cycle[0]
    group = [e for e in in_cycle if e.event == "hang"] if first.event == "hang" else [first]
    grouped = {id(e) for e in group}
    rest = [e for e in in_cycle if id(e) not in grouped]
    hang = _hang_info(group) if first.event == "hang" else None
    culprit = hang_culprit(cycle, group, events) if hang else None
    ranks = tuple(sorted({e.get("rank") for e in group if isinstance(e.get("rank"), int)}))
    return Failure(
        number=number,
        cycle=cycle,
        kind=_kind(first),
        ts=first.ts,
        nodes=culprit.nodes if culprit else tuple(dict.fromkeys(e.node for e in group)),
        ranks=culprit.ranks if culprit else ranks,
        cause=describe(group, hang, culprit),
        exit_code=first.get("code") if first.event == "worker_exited" else None,
        signal=first.get("signal"),
        hang=hang,
        secondary=tuple(f"{describe([e], None)} (+{e.ts - first.ts:.2f}s)" for e in rest),
        notes=tuple(_stale_hang_notes(group, events)),
        **timing.costs(first.ts, hang.waited if hang else 0.0),
    )


def _causes_first(in_cycle: Sequence[Event], events: Sequence[Event]) -> list[Event]:
    """The cycle's failure events with those of nodes whose failure was a cause (not a
    `secondary` consequence, by the node's own `failure` event) first, each in time order."""
    named = [e for e in events if e.event == "failure" and e.cycle == in_cycle[0].cycle]
    causes = {e.node for e in named if not e.get("secondary")}
    if not causes:
        return list(in_cycle)
    return sorted(in_cycle, key=lambda e: (e.node not in causes, e.ts))


def _node_lost(failure: Failure, lost: Sequence[str]) -> Failure:
    """A lost node is the cause; what failed on the others is its consequence."""
    names = ", ".join(lost)
    return dataclasses.replace(
        failure, kind=NODE_LOST, nodes=tuple(lost), ranks=(),
        cause=f"node {names} lost (its launcher and workers gone)",
        exit_code=None, signal=None, hang=None,
        secondary=(f"{failure.cause} (a consequence)", *failure.secondary),
    )  # fmt: skip


def _restart_without_failure(
    number: int, cycle: int, events: Sequence[Event], timing: _Timing
) -> Failure:
    """A cycle that restarted with no failure on record: a scale-up, or a spawn failure."""
    restarts = [e for e in events if e.event == "restart" and e.cycle == cycle]
    stops = [
        e.ts - e.num("duration") for e in events if e.event == "stop_done" and e.cycle == cycle
    ]
    causes = [e.get("cause") for e in restarts if e.get("cause")]
    ts = min(stops) if stops else (restarts[0].ts if restarts else timing.job_end)
    cause = causes[0] if causes else "restart with no failure event (scale-up or spawn failure)"
    return Failure(
        number=number,
        cycle=cycle,
        kind=RESTART,
        ts=ts,
        nodes=tuple(dict.fromkeys(e.node for e in restarts)),
        cause=cause,
        **timing.costs(ts, 0.0),
    )


def _kind(event: Event) -> str:
    kinds = {"worker_exited": CRASH, "hang": HANG, "signal": SIGNAL, "failure": HEALTH,
             "store_restarted": STORE_RESTARTED}  # fmt: skip
    return kinds.get(event.event, STORE_LOST)


def _hang_info(hangs: Sequence[Event]) -> HangInfo:
    first = hangs[0]
    latencies = [e.num("detection_latency") for e in hangs if "detection_latency" in e.fields]
    return HangInfo(
        kind=first.get("kind"),
        section=first.get("section"),
        timeout=first.num("timeout", None),
        waited=max(e.num("waited") for e in hangs),
        detection_latency=max(latencies) if latencies else None,
        stack_files=tuple(str(e.get("stack_file")) for e in hangs if e.get("stack_file")),
        where=_where_lines(hangs),
    )


def _where_lines(hangs: Sequence[Event]) -> tuple[str, ...]:
    """Group the hung ranks by where they were: `ranks 0-1 on n1, 3 on n0 waiting inside ...`."""
    places: dict[tuple[str, bool], list[Event]] = {}
    for hang in hangs:
        where = hang.get("where")
        if isinstance(where, str):
            places.setdefault((where, hang.get("in_library") is True), []).append(hang)
    mixed = len({in_library for _, in_library in places}) == 2
    lines = []
    # Own code first: when the others wait inside libraries, that is the likely cause.
    for (where, in_library), group in sorted(places.items(), key=lambda item: item[0][1]):
        line = f"rank{'s' if len(group) > 1 else ''} {_ranks_on_nodes(group)} {where}"
        if mixed and not in_library:
            line += "  <- likely the cause: the others wait inside libraries"
        lines.append(line)
    return tuple(lines)


def _ranks_on_nodes(events: Sequence[Event]) -> str:
    """`0-1 on n1, 3 on n0`, nodes in the order they first appear."""
    return ", ".join(
        f"{ranks_text([e.get('rank') for e in events if e.node == node])} on {node}"
        for node in dict.fromkeys(e.node for e in events)
    )


def describe(group: Sequence[Event], hang: HangInfo | None, culprit: Culprit | None = None) -> str:
    """One line saying what failed, where, and how; a hang names its `culprit` if known."""
    first = group[0]
    if first.event == "worker_exited":
        sig = first.get("signal")
        how = f"killed by {sig}" if sig else f"exit code {first.get('code')}"
        return f"rank {first.get('rank')} on {first.node} crashed: {how}"
    if first.event == "signal":
        return f"{first.get('signal')} on {first.node} (preemption or cancel)"
    if first.event == "failure":
        return f"health fault on {first.node}: {first.get('detail')} ({first.get('message', '')})"
    if first.event == "store_lost":
        return f"{first.node} lost the rendezvous store: {first.get('error', '?')}"
    if first.event == "store_restarted":
        nodes = ", ".join(dict.fromkeys(e.node for e in group))
        return f"the rendezvous store restarted empty; {nodes} wrote the job's state back"
    hang = hang or _hang_info(group)
    what = _HANG_TEXT.get(hang.kind, hang.kind)
    if hang.kind == "section":
        what = f"stuck in section {hang.section!r}"
    limit = f" (timeout {hang.timeout:g}s)" if hang.timeout is not None else ""
    if culprit is None:
        plural = "s" if len(group) > 1 else ""
        return f"rank{plural} {_ranks_on_nodes(group)} hung: {what} for {hang.waited:.2f}s{limit}"
    where = ", ".join(f"{ranks_text(ranks)} on {node}" for node, ranks in culprit.placed)
    plural = "s" if len(culprit.ranks) > 1 else ""
    text = f"rank{plural} {where or ranks_text(culprit.ranks)} hung ({culprit.why})"
    waiting = [e for e in group if e.get("rank") not in culprit.ranks]
    if waiting:
        text += f"; rank{'s' if len(waiting) > 1 else ''} {_ranks_on_nodes(waiting)} waited"
    return f"{text}: {what} for {hang.waited:.2f}s{limit}"


def ranks_text(ranks: Iterable[int]) -> str:
    """0,1,2,3,7 -> '0-3,7': whole nodes of ranks stay short."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _stale_hang_notes(group: Sequence[Event], events: Sequence[Event]) -> list[str]:
    """A verdict for a pid this cycle never started is a left-over from an earlier cycle: the
    restart it caused was spurious, which a person must know before blaming the code."""
    notes = []
    for hang in group:
        started = [
            e
            for e in events
            if e.event == "workers_started" and e.node == hang.node and e.cycle == hang.cycle
        ]
        pids = {p for e in started for p in e.get("pids", [])}
        if started and hang.get("pid") is not None and hang.get("pid") not in pids:
            notes.append(
                f"rank {hang.get('rank')} pid {hang.get('pid')} on {hang.node} is not a worker "
                f"of cycle {hang.cycle}: stale verdict from an earlier cycle (launcher bug?)"
            )
    return notes
