"""The report as text for a person, or as JSON for machines; both render a `Report` only.

The text is ordered the way a post-mortem reads: did the job make it, how much time it wasted,
then each cycle, then each failure with where to look next (stack files). Times measured on
processes rather than on training progress are labelled as such.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from ftrun.eventlog.failures import Failure, ranks_text
from ftrun.eventlog.report import Cycle, NodeInfo, Report, duration_text
from ftrun.eventlog.startup import startup_lines

JSON_SCHEMA_VERSION = 4
"""4: `attributions`, per failed cycle its signature, suspect, evidence and decision; `reruns`,
the re-run state machine's verdicts.
3: `startup`, per cycle where its slowest rank's start-up went.
2: training measured on progress (`progress_reported`, `startup_s`, `redone_s`, cycles'
`stepping_at`/`training_until`, failures' `redone_iterations`/`redone_s`), `timeline_note`."""
NO_PROGRESS = "no training progress reported (no RankMonitorClient): times below are process times"


def to_json(report: Report, timeline: str | None, timeline_note: str | None = None) -> str:
    """Every field of the report, times as epoch seconds; `timeline` is the PNG, if written,
    and `timeline_note` says why it was not."""
    data: dict[str, Any] = {"schema": JSON_SCHEMA_VERSION, **dataclasses.asdict(report)}
    data["timeline"] = timeline
    data["timeline_note"] = timeline_note
    return json.dumps(data, indent=2)


def to_text(report: Report, timeline: str | None, timeline_note: str | None = None) -> str:
    return "\n".join(_lines(report, timeline, timeline_note)) + "\n"


def _lines(report: Report, timeline: str | None, timeline_note: str | None) -> Iterator[str]:
    clock = _clock(report.start, report.end)
    yield f"ftrun report: {report.log_dir}"
    yield f"Outcome    {report.outcome}: {_exit_summary(report.nodes)}"
    yield (
        f"Wall time  {duration_text(report.wall_s)}  "
        f"({clock_text(report.start)} -> {clock_text(report.end)})"
    )
    yield from _training_lines(report)
    kinds = Counter(f.kind for f in report.failures)
    what = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    yield (
        f"Restarts   {len(report.cycles)} cycle(s), {len(report.failures)} failure(s)"
        + (f": {what}" if what else "")
    )
    yield from _node_lines(report.nodes)
    yield from _cycle_lines(report.cycles, clock, report.progress_reported)
    yield from startup_lines(report.startup)
    yield from _failure_lines(report.failures, clock, report.progress_reported)
    yield from _attribution_lines(report)
    yield from _rerun_lines(report)
    yield from _inprocess_lines(report)
    if timeline or timeline_note:
        yield ""
        yield f"Timeline   {timeline or timeline_note}"


def _training_lines(report: Report) -> Iterator[str]:
    wall, useful = duration_text(report.wall_s), duration_text(report.effective_s)
    if not report.progress_reported:
        yield f"Training   {NO_PROGRESS}"
        yield (
            f"           {report.effective_ratio:.1%} with all workers up and not known to be "
            f"failing: {useful} of {wall} (process time, an upper bound on training)"
        )
        return
    yield (
        f"Training   {report.effective_ratio:.1%} effective (ETTR, from training progress): "
        f"{useful} making progress of {wall}"
    )
    lost = []
    if report.startup_s is None:
        lost.append("the ranks never all stepped")
    else:
        lost.append(f"start-up {duration_text(report.startup_s)} (launch to every rank stepping)")
    failed = _union([(f.last_healthy, f.last_healthy + f.lost_s) for f in report.failures])
    if report.failures:
        lost.append(f"failures {duration_text(failed)} (last progress to stepping again)")
    if report.redone_s:
        lost.append(f"work redone ~{duration_text(report.redone_s)}")
    yield f"           lost: {', '.join(lost)}"


def _exit_summary(nodes: tuple[NodeInfo, ...]) -> str:
    """Nodes grouped by how they ended: a 64-node job must still fit on one line."""
    groups: dict[str, list[str]] = {}
    for node in nodes:
        if node.exit_code is None:
            key = "no exit event (killed?)"
        else:
            key = f"exit {node.exit_code} {node.exit_reason or ''}".rstrip()
        groups.setdefault(key, []).append(node.name)
    parts = []
    for key, names in groups.items():
        shown = ", ".join(names[:4]) + (f" +{len(names) - 4} more" if len(names) > 4 else "")
        parts.append(f"{key} on {len(names)} node(s) ({shown})")
    return "; ".join(parts)


def _node_lines(nodes: tuple[NodeInfo, ...]) -> Iterator[str]:
    yield ""
    yield f"Nodes ({len(nodes)})"
    width = max(len(n.name) for n in nodes)
    for node in nodes:
        group = "-" if node.group_rank is None else str(node.group_rank)
        ranks = ranks_text(node.ranks) or "-"
        host = "store host" if node.store_host else ""
        ending = "no exit event" if node.exit_code is None else f"exit {node.exit_code}"
        if node.exit_code and node.exit_why:
            ending += f" ({node.exit_why})"
        if node.unhealthy:
            ending += f"; UNHEALTHY: {node.unhealthy}"
        if node.standby_cycles:
            ending += f"; stood by as a hot spare in cycle(s) {ranks_text(node.standby_cycles)}"
        yield f"  {node.name:<{width}}  group rank {group:<3} ranks {ranks:<9} {host:<10}  {ending}"


def _union(windows: list[tuple[float, float]]) -> float:
    """Seconds covered by the windows, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(windows):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _cycle_lines(cycles: tuple[Cycle, ...], clock: _Clock, by_progress: bool) -> Iterator[str]:
    yield ""
    if not cycles:
        yield "Cycles: none (no rendezvous completed)"
        return
    yield f"Cycles ({len(cycles)})"
    width = max([len(clock(c.start)) for c in cycles] + [5])
    middle = "   start-up     training" if by_progress else "  all running"
    yield f"  cycle  {'start':<{width}}  rendezvous{middle}        stop  ended"
    for cycle in cycles:
        stop = "-" if cycle.stop_s is None else duration_text(cycle.stop_s)
        killed = f"; {cycle.killed} worker(s) SIGKILLed at the stop timeout" if cycle.killed else ""
        yield (
            f"  {cycle.number:>5}  {clock(cycle.start):<{width}}  "
            f"{duration_text(cycle.rendezvous_s):>10}  {_cycle_middle(cycle, by_progress)}  "
            f"{stop:>10}  {cycle.ended}{killed}"
        )


def _cycle_middle(cycle: Cycle, by_progress: bool) -> str:
    """Process mode: all workers running. Progress mode: workers started to every rank
    stepping ("never": they did not all step), then stepping to the last progress."""
    if not by_progress:
        running = "-" if cycle.running_at is None else duration_text(cycle.end - cycle.running_at)
        return f"{running:>11}"
    if cycle.running_at is None:
        startup = training = "-"
    elif cycle.stepping_at is None:
        startup, training = "never", "-"
    else:
        startup = duration_text(max(cycle.stepping_at - cycle.running_at, 0.0))
        until = cycle.training_until if cycle.training_until is not None else cycle.end
        training = duration_text(max(until - cycle.stepping_at, 0.0))
    return f"{startup:>10}  {training:>11}"


def _failure_lines(
    failures: tuple[Failure, ...], clock: _Clock, by_progress: bool
) -> Iterator[str]:
    if not failures:
        return
    yield ""
    measured = (
        "recovery: to every rank stepping again; time lost: from the last progress"
        if by_progress
        else "process times: recovery to every worker started again, not to training"
    )
    yield f"Failures ({len(failures)})  {measured}"
    for failure in failures:
        yield (
            f"  #{failure.number} cycle {failure.cycle} at {clock(failure.ts)}  "
            f"{failure.kind.upper()}: {failure.cause}"
        )
        recovery = (
            "not recovered (job ended)"
            if failure.recovery_s is None
            else f"recovery {duration_text(failure.recovery_s)}"
        )
        yield (
            f"     detection {_detection(failure)} | {recovery} | "
            f"time lost {duration_text(failure.lost_s)}{_redone(failure)}"
        )
        if failure.hang:
            yield from _listed("where", failure.hang.where)
            yield from _listed("stacks", failure.hang.stack_files)
        for line in failure.secondary:
            yield f"     then: {line}"
        for note in failure.notes:
            yield f"     NOTE: {note}"


def _listed(label: str, lines: tuple[str, ...]) -> Iterator[str]:
    """`label: first`, the others aligned under it."""
    for i, line in enumerate(lines):
        yield f"     {label}: {line}" if i == 0 else f"{'':{len(label) + 7}}{line}"


def _attribution_lines(report: Report) -> Iterator[str]:
    if not report.attributions:
        return
    yield ""
    yield "Attribution  (signature | suspect | evidence | decision)"
    for found in report.attributions:
        rank = f" rank {found.rank}" if found.rank is not None else ""
        yield f"  cycle {found.cycle}  {found.signature}"
        yield f"     suspect: {found.node}{rank}"
        for line in found.evidence:
            yield f"     evidence: {line}"
        yield f"     decision: {found.decision}"


def _rerun_lines(report: Report) -> Iterator[str]:
    if not report.reruns:
        return
    yield ""
    yield "Re-runs  (ftrun.rerun: a rejected result re-run in place, then on another node)"
    for v in report.reruns:
        yield (f"  cycle {v.cycle} iteration {v.iteration} rank {v.rank}: {v.diagnostic} "
               f"({v.message}): first {v.initial}, re-run {v.rerun}; suspect node "
               f"{v.suspect_node}: {v.outcome}")  # fmt: skip


def _inprocess_lines(report: Report) -> Iterator[str]:
    if not report.inprocess:
        return
    yield ""
    yield "In-process restarts  (ftrun.inprocess: recovered without a launcher cycle)"
    for r in report.inprocess:
        took = f"{r.seconds:.3f}s" if r.seconds is not None else "?"
        source = f"rank {r.from_rank}" if r.from_rank is not None else "the agent"
        yield (f"  cycle {r.cycle} iteration {r.iteration} -> {r.iteration + 1}: {r.kind} "
               f"from {source} | {r.tier} | every rank ready {took} after the fault | "
               f"{r.why}")  # fmt: skip


def _redone(failure: Failure) -> str:
    if failure.redone_iterations is None:
        return ""
    cost = f" (~{duration_text(failure.redone_s)})" if failure.redone_s is not None else ""
    return f" | {failure.redone_iterations} iteration(s) redone{cost}"


def _detection(failure: Failure) -> str:
    """A crash is seen when the process exits; a hang only when its timeout runs out."""
    hang = failure.hang
    if hang is None:
        return "0s (immediate)"
    parts = [f"{duration_text(hang.waited)} without progress"]
    if hang.timeout is not None:
        parts.append(f"timeout {hang.timeout:g}s")
    if hang.detection_latency is not None:
        parts.append(f"verdict {hang.detection_latency * 1000:.1f}ms after the deadline")
    return f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]


def _local(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts).astimezone()


def clock_text(ts: float) -> str:
    """A local date and time, for titles."""
    return _local(ts).strftime("%Y-%m-%d %H:%M:%S")


_Clock = Callable[[float], str]


def _clock(start: float, end: float) -> _Clock:
    """Local wall-clock times, short: the date only where a job crosses midnight needs it."""
    multi_day = _local(start).date() != _local(end).date()
    return lambda ts: _local(ts).strftime("%m-%d %H:%M:%S" if multi_day else "%H:%M:%S")
