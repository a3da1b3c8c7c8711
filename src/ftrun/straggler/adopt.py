"""Which report interval and node name the agents use: pure, from the launcher's setting and what
the ranks gave `Detector.initialize` (NVRx's `report_time_interval` and `node_name`).

- The interval: the launcher's (`--ft-straggler-report-interval`, or `straggler.json`) when it
  was given, whatever the ranks asked; else the smallest interval any rank asked; else
  `DEFAULT_REPORT_INTERVAL`. Every node must report on the same clock (the reporting agent
  merges one record per node and interval), so a node starts with its own ranks' choice, the
  reporting agent chooses from every node's asks (carried in their records) and publishes its
  choice with each report, and the other nodes follow it (`followed`).
- The node name: the one the node's ranks gave (the smallest if they differ), else the agent's
  own; it names the node's ranks in the report (NVRx's `rank_to_node`). The agents still act on
  (and write events with) their own node names.

A disagreement (ranks among themselves, or with the launcher's setting) is one warning line per
agent and distinct disagreement (`Choice.key`), never one per report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from ftrun.config.straggler import DEFAULT_REPORT_INTERVAL
from ftrun.eventlog.failures import ranks_text

FLAG = "--ft-straggler-report-interval"
_RANGES_SHOWN = 8


@dataclasses.dataclass(frozen=True)
class Choice:
    """A setting and why: `source` is 'launcher', 'workers' or 'default'."""

    value: Any
    """The interval in seconds (`choose_interval`); the node's name or None (`choose_name`)."""
    source: str
    conflict: str | None = None
    """The warning line when ranks disagree (with each other or with the launcher)."""
    key: Hashable = None
    """What the disagreement is (the values in play): the same key is warned about once."""


def choose_interval(flag: float | None, asks: Mapping[int, float]) -> Choice:
    """The report interval from the launcher's setting (None: not given) and rank -> the
    `report_time_interval` it asked."""
    values = sorted(set(asks.values()))
    if flag is not None:
        others = {rank: value for rank, value in asks.items() if value != flag}
        if not others:
            return Choice(flag, "launcher")
        why = (
            f"{FLAG}={flag:g} s is used: it was given, and {_asked(others)} "
            "(a report_time_interval given to Detector.initialize)"
        )
        return Choice(flag, "launcher", why, ("launcher", flag, *sorted(set(others.values()))))
    if not values:
        return Choice(DEFAULT_REPORT_INTERVAL, "default")
    if len(values) == 1:
        return Choice(values[0], "workers")
    why = f"ranks disagree: {_asked(asks)}; the smallest, {values[0]:g} s, is used"
    return Choice(values[0], "workers", why, ("workers", *values))


def choose_name(own: str, names: Mapping[int, str | None]) -> Choice:
    """The node's name in reports (None: the agent's own, `own`) from rank -> the `node_name`
    it gave (None: not given)."""
    given = sorted({name for name in names.values() if name is not None})
    if not given:
        return Choice(None, "default")
    if len(given) == 1:
        return Choice(given[0], "workers")
    groups = _groups({rank: name for rank, name in names.items() if name is not None})
    listed = "; ".join(f"{_ranks(ranks)} gave node_name={name!r}" for name, ranks in groups)
    why = f"ranks of node {own} disagree: {listed}; the smallest, {given[0]!r}, is used"
    return Choice(given[0], "workers", why, ("node_name", *given))


def followed(flag: float | None, own: Choice, published: float | None) -> float:
    """The interval a node reports on: the launcher's when given; else the reporting agent's
    published choice (this cycle's); else its own ranks' choice."""
    if flag is not None:
        return flag
    return published if published is not None else own.value


def published_interval(data: Mapping[str, object]) -> float | None:
    """The interval a report (its JSON data) says the reporting agent uses, if valid."""
    value = data.get("interval")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(value) if value < float("inf") else None


def _asked(asks: Mapping[int, float]) -> str:
    return "; ".join(f"{_ranks(ranks)} asked {value:g} s" for value, ranks in _groups(asks))


def _groups(by_rank: Mapping[int, object]) -> list[tuple[object, list[int]]]:
    found: dict[object, list[int]] = {}
    for rank in sorted(by_rank):
        found.setdefault(by_rank[rank], []).append(rank)
    return sorted(found.items(), key=lambda item: item[1][0])


def _ranks(ranks: Iterable[int]) -> str:
    """'rank 3', 'ranks 0-3,8' (at most a few ranges, then '...')."""
    ordered = sorted(ranks)
    ranges = ranks_text(ordered).split(",")
    shown = ",".join(ranges[:_RANGES_SHOWN]) + (",..." if len(ranges) > _RANGES_SHOWN else "")
    return f"rank {shown}" if len(ordered) == 1 else f"ranks {shown}"
