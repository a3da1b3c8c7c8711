"""In-process restarts in the event log: which tier recovered each fault, and in how long.

A restart iteration of wrapped ranks (`ftrun.inprocess`) is told by every node whose ranks
took part (`inprocess_recovered`); the report shows it once, with the slowest node's seconds
from the fault to every rank ready. A restart caused by a lost process (kind TERMINATED: the agent
started that rank's process again, `rank_replaced`) is the "replace rank" tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ftrun.eventlog.reader import Event


@dataclasses.dataclass(frozen=True)
class InprocessRestart:
    cycle: int
    iteration: int
    kind: str
    from_rank: int | None
    why: str
    seconds: float | None
    """From the fault to every rank ready at the iteration's barrier (the slowest node's)."""
    tier: str
    """"in-process", or "replace rank N" when a lost rank's process was started again."""


def inprocess_restarts(events: Sequence[Event]) -> tuple[InprocessRestart, ...]:
    by_iteration: dict[tuple[int, int], InprocessRestart] = {}
    for e in (e for e in events if e.event == "inprocess_recovered"):
        key = (e.cycle, int(e.get("iteration", -1)))
        seconds = e.num("seconds", None)
        rank = e.get("from_rank")
        rank = int(rank) if isinstance(rank, int) else None
        known = by_iteration.get(key)
        if known is not None and known.seconds is not None:
            seconds = max(known.seconds, seconds) if seconds is not None else known.seconds
        kind = str(e.get("kind", "?"))
        # TERMINATED comes from the agent alone, when it started a lost rank's process again.
        tier = f"replace rank {rank}" if kind == "TERMINATED" else "in-process"
        by_iteration[key] = InprocessRestart(e.cycle, key[1], kind, rank,
                                             str(e.get("why", "")), seconds, tier)  # fmt: skip
    return tuple(by_iteration[k] for k in sorted(by_iteration))
