"""The job as a picture: one lane per node, its states as coloured bars, failures marked.

Lost time is drawn as lost: start-up (launch to every rank stepping) and each failure's window
(last progress to stepping again) are hatched, and a lane is green only while its ranks step.
Without a progress report the bars are process states, and the title says so.

Drawn on a bare `Figure` with the Agg canvas, never through pyplot: no GUI backend is picked,
no global state is left behind, and importing this module is the only place matplotlib loads
(the summary must work without it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.path import Path as MarkerPath
from matplotlib.ticker import FuncFormatter, MultipleLocator

from ftrun.eventlog.failures import CRASH, HANG, SIGNAL, Failure, ranks_text
from ftrun.eventlog.lanes import FINISHED, RENDEZVOUS, RUNNING, STALLED, STARTING, STOPPING
from ftrun.eventlog.report import NodeInfo, Report, duration_text
from ftrun.tools.summary import clock_text

STATE_STYLE = {  # (colour, legend label); colour-blind-safe hues, "bad" states warm
    RENDEZVOUS: ("#E69F00", "rendezvous / health check"),
    STARTING: ("#F0E442", "workers starting (no step yet)"),
    RUNNING: ("#009E73", "training (ranks stepping)"),
    STALLED: ("#CC79A7", "no progress, until stopped"),
    STOPPING: ("#D55E00", "stopping workers"),
    FINISHED: ("#A6DBA0", "finished, waiting"),
}
_PROCESS_RUNNING = "workers running (no progress reported)"
_HOURGLASS = MarkerPath(
    [(-1, 1), (1, 1), (-1, -1), (1, -1), (-1, 1)],
    [MarkerPath.MOVETO, *[MarkerPath.LINETO] * 3, MarkerPath.CLOSEPOLY],
)
MARKERS = {CRASH: ("X", "#B00020"), HANG: (_HOURGLASS, "#6A1B9A")}
_OTHER_MARKER = ("D", "#37474F")  # signal, store lost, restart without failure
_UNHEALTHY_MARKER = ("P", "#C2185B")
_LOST_COLOUR = "#B00020"
_BAR_HEIGHT = 0.5
_MAX_LABELLED = 10
_MIN_WIDTH = 0.004  # of the time axis: about 5 pixels
_TICK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)


def draw_timeline(report: Report, path: Path) -> None:
    """Write the timeline PNG of `report` to `path`."""
    # Nodes top to bottom in the report's order: by group rank, so ranks read downwards.
    lanes = {node.name: i for i, node in enumerate(report.nodes)}
    height = min(2.6 + 0.55 * len(lanes), 40.0)
    fig = Figure(figsize=(13, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_cycles(ax, report)
    _draw_lanes(ax, report, lanes)
    _shade_startup(ax, report, len(lanes))
    for failure in report.failures:
        _draw_failure(ax, report, failure, lanes)
    _draw_unhealthy(ax, report, lanes)
    _decorate(ax, fig, report, lanes)
    fig.savefig(path, dpi=110)


def _draw_lanes(ax: Axes, report: Report, lanes: dict[str, int]) -> None:
    # A 40 s rendezvous in an 8 h night is under a pixel wide: give the short states a minimum
    # width, so every restart stays visible (running bars keep their true length).
    least = _MIN_WIDTH * _span(report)
    for state, (colour, _label) in STATE_STYLE.items():
        widen = state in (RENDEZVOUS, STARTING, STALLED, STOPPING)
        for node, lane in lanes.items():
            bars = [
                (s.start - report.start, max(s.end - s.start, least if widen else 0.0))
                for s in report.spans
                if s.node == node and s.state == state
            ]
            if bars:
                ax.broken_barh(bars, (lane - _BAR_HEIGHT / 2, _BAR_HEIGHT), facecolors=colour,
                               edgecolor="white", linewidth=0.5, zorder=2)  # fmt: skip


def _draw_cycles(ax: Axes, report: Report) -> None:
    """Alternate shading per cycle and its number on top: restarts read as chapters."""
    cycles = report.cycles
    for i, cycle in enumerate(cycles):
        start = cycle.start - report.start
        end = (cycles[i + 1].start if i + 1 < len(cycles) else report.end) - report.start
        if i % 2:
            ax.axvspan(start, end, color="#000000", alpha=0.04, linewidth=0, zorder=0)
        ax.annotate(
            f"cycle {cycle.number}", xy=((start + end) / 2, 1.0),
            xycoords=("data", "axes fraction"), xytext=(0, 3), textcoords="offset points",
            ha="center", va="bottom", fontsize=9, color="#444444", annotation_clip=False,
        )  # fmt: skip


def _draw_failure(ax: Axes, report: Report, failure: Failure, lanes: dict[str, int]) -> None:
    """Marker on each failing node's lane, a restart line across all, the lost time shaded."""
    x = failure.ts - report.start
    marker, colour = MARKERS.get(failure.kind, _OTHER_MARKER)
    ax.axvline(x, color=colour, linestyle="--", linewidth=1.1, alpha=0.8, zorder=3)
    rows = [lanes[n] for n in failure.nodes if n in lanes] or [len(lanes) - 0.5]
    ax.scatter([x] * len(rows), rows, marker=marker, s=150, color=colour, edgecolors="white",
               linewidths=0.8, zorder=5)  # fmt: skip
    _shade_lost(ax, report, failure, len(lanes))
    # a night of many restarts: numbers only, the text report has the details
    text = f"#{failure.number}"
    if len(report.failures) <= _MAX_LABELLED:
        text += f" {_short_label(failure)}"
    above = 14 if failure.number % 2 else -18  # neighbours alternate
    _note(ax, report, (x, min(rows)), above, text, colour, va="center", fontweight="bold")


def _draw_unhealthy(ax: Axes, report: Report, lanes: dict[str, int]) -> None:
    """A node that failed its health check left the job: say why, where it left."""
    marker, colour = _UNHEALTHY_MARKER
    for node in report.nodes:
        if node.unhealthy_at is None:
            continue
        x = node.unhealthy_at - report.start
        ax.scatter([x], [lanes[node.name]], marker=marker, s=150, color=colour, zorder=5)
        reason = node.unhealthy or ""
        reason = reason if len(reason) <= 40 else reason[:39] + "..."
        _note(ax, report, (x, lanes[node.name]), 14, f"unhealthy: {reason}", colour)


def _note(
    ax: Axes, report: Report, xy: tuple[float, float], above: float, text: str, colour: str,
    **style: str,
) -> None:  # fmt: skip
    """A boxed label `above` points over `xy`, beside it; near the end of the time axis it
    grows leftwards, staying inside."""
    right_side = xy[0] > 0.7 * _span(report)
    ax.annotate(
        text, xy=xy, xytext=(-8 if right_side else 8, above), textcoords="offset points",
        ha="right" if right_side else "left", fontsize=8.5, color=colour, zorder=6,
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": colour, "alpha": 0.85}, **style,
    )  # fmt: skip


def _shade_startup(ax: Axes, report: Report, n_lanes: int) -> None:
    """Launch to every rank stepping: time the job paid before it trained at all."""
    if not report.progress_reported:
        return
    until = report.startup_s if report.startup_s is not None else _span(report)
    _hatch(ax, report, 0.0, until, f"start-up {duration_text(until)}", n_lanes)


def _shade_lost(ax: Axes, report: Report, failure: Failure, n_lanes: int) -> None:
    until = failure.recovered_at if failure.recovered_at is not None else report.end
    start, end = failure.last_healthy - report.start, until - report.start
    _hatch(ax, report, start, end, f"lost {duration_text(failure.lost_s)}", n_lanes)


def _hatch(ax: Axes, report: Report, start: float, end: float, label: str, n_lanes: int) -> None:
    end = max(end, start + _MIN_WIDTH * _span(report))
    ax.axvspan(start, end, ymin=0, ymax=1, facecolor=_LOST_COLOUR, alpha=0.10, hatch="///",
               edgecolor=_LOST_COLOUR, linewidth=0, zorder=1)  # fmt: skip
    ax.annotate(
        label, xy=((start + end) / 2, n_lanes - 0.5), xytext=(0, 2), textcoords="offset points",
        ha="center", va="bottom", fontsize=8, color=_LOST_COLOUR, zorder=6,
        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
    )  # fmt: skip


def _short_label(failure: Failure) -> str:
    ranks = ranks_text(failure.ranks)
    if failure.kind == CRASH:
        how = f"sig {failure.signal}" if failure.signal else f"exit {failure.exit_code}"
        return f"crash: rank {ranks}, {how}"
    if failure.kind == HANG and failure.hang is not None:
        what = failure.hang.section or failure.hang.kind
        stale = ", stale verdict?" if failure.notes else ""
        return f"hang: rank{'s' if len(failure.ranks) > 1 else ''} {ranks} ({what}{stale})"
    if failure.kind == SIGNAL:
        return f"{failure.signal}: preempted"
    return failure.kind


def _decorate(ax: Axes, fig: Figure, report: Report, lanes: dict[str, int]) -> None:
    nodes = {n.name: n for n in report.nodes}
    ax.set_yticks(list(lanes.values()), [_lane_label(nodes[name]) for name in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first node on top, like a log read downwards
    ax.set_xlim(0, _span(report))
    ax.xaxis.set_major_locator(MultipleLocator(_tick_step(_span(report))))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _elapsed(x)))
    ax.set_xlabel(f"time since job start ({clock_text(report.start)})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = Counter(f.kind for f in report.failures)
    failures = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"
    fig.suptitle(
        f"Job {report.outcome}: {len(report.nodes)} node(s), {len(report.cycles)} cycle(s), "
        f"{len(report.failures)} failure(s) ({failures})", fontsize=13, fontweight="bold",
    )  # fmt: skip
    if report.progress_reported:
        ratio = f"{report.effective_ratio:.0%} effective training (ETTR, from progress)"
    else:
        ratio = (
            f"no training progress reported: {report.effective_ratio:.0%} with workers up "
            "(process time)"
        )
    title = f"{report.log_dir}  |  wall {duration_text(report.wall_s)}, {ratio}"
    ax.set_title(title, fontsize=9.5, color="#444444", pad=16)
    handles = _legend_handles(report)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5))


def _lane_label(node: NodeInfo) -> str:
    ranks = ranks_text(node.ranks)
    return f"{node.name}\nranks {ranks}" if ranks else node.name


def _legend_handles(report: Report) -> list[Patch | Line2D]:
    failures = report.failures
    shown = {s.state for s in report.spans}
    handles: list[Patch | Line2D] = [
        Patch(
            facecolor=colour,
            label=label if state != RUNNING or report.progress_reported else _PROCESS_RUNNING,
        )
        for state, (colour, label) in STATE_STYLE.items()
        if state in shown or state in (RENDEZVOUS, RUNNING)
    ]
    kinds = dict.fromkeys(f.kind for f in failures)
    marks = [(*MARKERS.get(kind, _OTHER_MARKER), kind) for kind in kinds]
    if any(node.unhealthy_at is not None for node in report.nodes):
        marks.append((*_UNHEALTHY_MARKER, "unhealthy node"))
    handles += [
        Line2D([], [], marker=marker, color=colour, linestyle="", markersize=10, label=label)
        for marker, colour, label in marks
    ]
    if failures:
        handles.append(Line2D([], [], color="#555555", linestyle="--", label="cycle ends"))
    if failures or report.progress_reported:
        lost = (
            "time lost: start-up, last progress to stepping again"
            if report.progress_reported
            else "time lost (process time: to workers running again)"
        )
        handles.append(
            Patch(facecolor=_LOST_COLOUR, alpha=0.15, hatch="///", edgecolor=_LOST_COLOUR,
                  label=lost)
        )  # fmt: skip
    return handles


def _span(report: Report) -> float:
    return max(report.end - report.start, 1e-3)


def _tick_step(span: float) -> float:
    """Round steps in seconds (10 s, 5 min, 1 h...) for about 6 to 12 ticks."""
    return next((step for step in _TICK_STEPS if span / step <= 12), span / 10)


def _elapsed(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
