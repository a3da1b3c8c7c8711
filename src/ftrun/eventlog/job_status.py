"""The job's status, one JSON document: what the page, `/status.json` and `ftrun status` show.

`job_status` is a pure function of the job's events (every node's, as `ftrun report` reads
them), the nodes' live progress records and the time: the cycle and the time lost come from
`build_report` itself (the report's definitions, with the running job's states lasting until
now), the nodes' states from `NodeView`. `status_table` renders it as text for a terminal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrun.eventlog.node_view import NodeState, NodeView
from ftrun.eventlog.reader import Event, EventSet
from ftrun.eventlog.report import build_report, duration_text, node_order

SCHEMA = 1
SHOWN_FAILURES = 10
SHOWN_STRAGGLERS = 8
SILENT_AFTER_S = 15.0
"""A running node whose live record is older than this is shown as silent."""


def job_status(
    job: str, events: Mapping[str, Sequence[Event]], live: Mapping[str, Mapping[str, Any]],
    now: float,
) -> dict[str, Any]:  # fmt: skip
    """Everything the page shows, as JSON-able data; `events` by node, `live` by node."""
    nodes = {name: evs for name, evs in events.items() if evs}
    if not nodes:
        return {"schema": SCHEMA, "job": job, "now": now, "nodes": [], "waiting": True}
    views = {name: _view(name, evs) for name, evs in nodes.items()}
    over = all(v.state is NodeState.EXITED for v in views.values())
    report = build_report(EventSet(Path("."), nodes, ()), now=None if over else now)
    _mark_lost(views, [e for evs in nodes.values() for e in evs if e.event == "node_lost"])
    cycle = max(v.cycle for v in views.values())
    in_rank_order = sorted(views.values(), key=lambda v: node_order(v.group_rank, v.node))
    return {
        "schema": SCHEMA,
        "job": job,
        "now": now,
        "outcome": "RUNNING" if report.outcome == "INCOMPLETE" else report.outcome,
        "cycle": cycle,
        "restarts": sum(1 for c in report.cycles if c.outcome == "failed"),
        "inprocess_restarts": len(report.inprocess),
        "wall_s": report.wall_s,
        "effective_s": report.effective_s,
        "lost_s": max(report.wall_s - report.effective_s, 0.0),
        "ettr": report.effective_ratio,
        "progress_reported": report.progress_reported,
        "nodes": [_node(view, live.get(view.node, {}), now) for view in in_rank_order],
        "failures": [dataclasses.asdict(a) for a in report.attributions[-SHOWN_FAILURES:]][::-1],
        "stragglers": _stragglers(views.values()),
        "checkpoints": _tiers(views.values(), cycle),
    }


def _view(name: str, events: Sequence[Event]) -> NodeView:
    view = NodeView(name)
    for event in events:  # as the record `EventLog` wrote, which `NodeView.apply` takes
        view.apply({"event": event.event, "ts": event.ts, "cycle": event.cycle, **event.fields})
    return view


def _mark_lost(views: Mapping[str, NodeView], told: Sequence[Event]) -> None:
    for event in told:
        for name in event.get("nodes") or ():
            view = views.get(name)
            if view is not None and view.since <= event.ts and view.state is not NodeState.EXITED:
                view.state, view.since = NodeState.LOST, event.ts


def _node(view: NodeView, live: Mapping[str, Any], now: float) -> dict[str, Any]:
    node = view.summary()
    current = live.get("cycle") == view.cycle and view.state is NodeState.STEPPING
    progress = live.get("progress") if current else None
    published = live.get("ts") or 0.0
    node["progress"] = [
        [rank, iteration, None if age is None else round(age + max(now - published, 0.0), 3)]
        for rank, iteration, age in (progress or [])
    ]
    node["silent"] = current and now - published > SILENT_AFTER_S
    node["last_failure"] = view.last_failures[-1] if view.last_failures else None
    return node


def _stragglers(views: Sequence[NodeView] | Any) -> dict[str, Any] | None:
    reports = [v.stragglers for v in views if v.stragglers]
    if not reports:
        return None
    last = max(reports, key=lambda r: r.get("ts") or 0.0)
    return {**last, "worst": (last.get("worst") or [])[:SHOWN_STRAGGLERS]}


def _tiers(views: Sequence[NodeView] | Any, cycle: int) -> dict[str, dict[str, Any]]:
    """Per tier, the iteration every node of the current cycle holds (the job's newest
    complete one), the worst replication lag and the longest save stall seen."""
    current = [v for v in views if v.cycle == cycle and v.state is not NodeState.STANDBY]
    found: dict[str, dict[str, Any]] = {}
    for tier in sorted({t for v in current for t in v.tiers}):
        held = [v.tiers.get(tier) for v in current]
        complete = all(h is not None for h in held)
        lags = [h.lag for h in held if h is not None and h.lag is not None]
        stalls = [h.stall for h in held if h is not None and h.stall is not None]
        found[tier] = {
            "iteration": min(h.iteration for h in held if h) if complete else None,
            "newest": max(h.iteration for h in held if h),
            "lag_s": max(lags) if lags else None,
            "stall_s": max(stalls) if stalls else None,
        }
    return found


def status_table(status: Mapping[str, Any]) -> str:
    """The status as plain text: a header, the nodes, the last failures."""
    return "\n".join(_table_lines(status)) + "\n"


def _table_lines(status: Mapping[str, Any]) -> Iterator[str]:
    if status.get("waiting"):
        yield f"job {status.get('job')}: no events yet"
        return
    yield (
        f"job {status['job']}  {status['outcome']}  cycle {status['cycle']}  "
        f"restarts {status['restarts']}  lost {duration_text(status['lost_s'])} of "
        f"{duration_text(status['wall_s'])}  ETTR {status['ettr']:.1%}"
    )
    yield _HEADER
    for node in status["nodes"]:
        yield _node_line(node)
    if failures := status.get("failures"):
        yield "failures (newest first):"
        for failure in failures:
            yield (
                f"  cycle {failure['cycle']}: {failure['signature']} on {failure['node']}"
                + (f" rank {failure['rank']}" if failure.get("rank") is not None else "")
                + f" -> {failure['decision']}"
            )
    stragglers = status.get("stragglers")
    if stragglers and stragglers.get("worst"):
        worst = ", ".join(f"rank {r} ({n}) {s:.2f}" for r, n, s in stragglers["worst"][:3])
        yield f"stragglers: {worst}  (median {stragglers.get('median')})"
    for tier, held in (status.get("checkpoints") or {}).items():
        lag = f", lag {held['lag_s']:.2f} s" if held.get("lag_s") is not None else ""
        stall = f", save stall {held['stall_s']:.3f} s" if held.get("stall_s") is not None else ""
        yield (
            f"checkpoint {tier}: iteration {held['iteration']} "
            f"(newest {held['newest']}{lag}{stall})"
        )


_HEADER = (
    f"{'NODE':<20} {'STATE':<11} {'RANKS':<12} {'STEPPING':>8} {'ITER':>8} {'AGE':>7}  LAST FAILURE"
)


def _node_line(node: Mapping[str, Any]) -> str:
    ranks = node.get("ranks") or []
    span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else ",".join(map(str, ranks)) or "-"
    progress = node.get("progress") or []
    iterations = [p[1] for p in progress if p[1] is not None]
    ages = [p[2] for p in progress if p[2] is not None]
    state = node["state"] + ("?" if node.get("silent") else "")
    failure = node.get("last_failure")
    what = f"{failure['kind']}: {failure.get('detail', '')}" if failure else ""
    return (
        f"{node['node']:<20} {state:<11} {span:<12} {len(node.get('stepping') or []):>8} "
        f"{min(iterations) if iterations else '-':>8} "
        f"{f'{max(ages):.1f}s' if ages else '-':>7}  {what}"
    )
