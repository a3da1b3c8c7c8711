"""Per-rank straggler scores over time, from the `straggler_report` events, as text.

One row per rank that was ever among a report's worst (at most `MAX_ROWS`, the lowest first),
one column per report (the last `MAX_COLUMNS`), each cell a shade of the rank's lowest score of
any kind in that report: '█' >= 0.95, '▓' >= 0.85, '▒' >= 0.75, '░' >= 0.5, '·' below, ' ' not
among that report's worst. `ftrun report` prints it under the summary when the job ran the
detector.
"""

from __future__ import annotations

from ftrun.eventlog.reader import EventSet

MAX_ROWS = 16
MAX_COLUMNS = 60
_SHADES = ((0.95, "█"), (0.85, "▓"), (0.75, "▒"), (0.5, "░"))


def shade(score: float) -> str:
    return next((mark for limit, mark in _SHADES if score >= limit), "·")


def scores_picture(events: EventSet) -> str:
    """The picture, or "" when no straggler report was written."""
    every = [e for node_events in events.nodes.values() for e in node_events]
    reports = [e for e in every if e.event == "straggler_report"]
    reports = sorted(reports, key=lambda e: (e.cycle, e.ts))[-MAX_COLUMNS:]
    if not reports:
        return ""
    cells: dict[tuple[int, str], dict[int, float]] = {}
    for column, event in enumerate(reports):
        for rank, node, score in event.get("worst") or []:
            cells.setdefault((rank, node), {})[column] = score
    rows = sorted(cells.items(), key=lambda item: (min(item[1].values()), item[0][0]))[:MAX_ROWS]
    width = max(len(f"{rank} {node}") for (rank, node), _ in rows)
    legend = "█ >= .95 ▓ >= .85 ▒ >= .75 ░ >= .5 · lower"
    lines = [f"Straggler scores, last {len(reports)} reports ({legend})"]
    for (rank, node), by_column in rows:
        bar = "".join(shade(by_column[c]) if c in by_column else " " for c in range(len(reports)))
        label = f"{rank} {node}".ljust(width)
        lines.append(f"  {label} |{bar}| min {min(by_column.values()):.2f}")
    found = sum(1 for e in every if e.event == "straggler")
    lines.append(f"  {found} report(s) named stragglers")
    return "\n".join(lines) + "\n"
