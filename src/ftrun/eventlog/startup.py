"""Where each cycle's start-up went: the `rank_startup` events, one line per cycle.

Each rank's launcher records, from the moment it began starting that cycle's workers, when the
rank's script began (forked workers only: a fresh interpreter cannot be watched before its
script runs), when it first used CUDA, when `init_process_group` returned, and when it first
showed progress. A cycle is only as fast as its slowest rank, so the line shows that rank; the
rest of its time (after the process group) is the script's own: model build, checkpoint load,
the first step. Without a RankMonitorClient the first step is unknown: the slowest rank is then
the one whose last mark came latest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from ftrun.eventlog.reader import Event


@dataclasses.dataclass(frozen=True)
class StartupSplit:
    """The slowest rank of one cycle (seconds from its launcher's start of the workers)."""

    cycle: int
    node: str
    rank: int
    path: str
    """'forked', 'spawned', or 'mixed' when the cycle's ranks started both ways."""
    ranks: int
    to_script: float | None
    to_cuda: float | None
    to_pg: float | None
    to_first_step: float | None
    """None: the rank showed no progress (no RankMonitorClient)."""


def startup_splits(events: Iterable[Event]) -> tuple[StartupSplit, ...]:
    """One split per cycle with `rank_startup` events, in cycle order."""
    by_cycle: dict[int, list[Event]] = {}
    for event in events:
        if event.event == "rank_startup":
            by_cycle.setdefault(event.cycle, []).append(event)
    return tuple(_split(cycle, by_cycle[cycle]) for cycle in sorted(by_cycle))


def _split(cycle: int, ranks: Sequence[Event]) -> StartupSplit:
    slowest = max(ranks, key=_reached)
    paths = {e.get("path") for e in ranks}
    return StartupSplit(
        cycle=cycle,
        node=slowest.node,
        rank=int(slowest.num("rank")),
        path=paths.pop() if len(paths) == 1 else "mixed",
        ranks=len(ranks),
        to_script=slowest.num("to_script", None),
        to_cuda=slowest.num("to_cuda", None),
        to_pg=slowest.num("to_pg", None),
        to_first_step=slowest.num("to_first_step", None),
    )


def _reached(event: Event) -> float:
    """How far into its start the rank was seen last: its first step, else its last mark."""
    for key in ("to_first_step", "to_pg", "to_cuda", "to_script"):
        if (value := event.num(key, None)) is not None:
            return value
    return 0.0


def startup_lines(splits: Sequence[StartupSplit]) -> Iterator[str]:
    """The text report's section: where each cycle's start-up went, slowest rank."""
    if not splits:
        return
    yield ""
    yield (
        "Start-up by cycle  (slowest rank; seconds from its workers' start to: script, first "
        "CUDA use, process group, first step; the script's own = model, load, first step)"
    )
    yield "  cycle  rank      path     script    CUDA      group     first step  script's own"
    for split in splits:
        own = None
        if split.to_pg is not None and split.to_first_step is not None:
            own = max(split.to_first_step - split.to_pg, 0.0)
        yield (
            f"  {split.cycle:>5}  {split.rank:<8}  {split.path:<7}  {_secs(split.to_script)}  "
            f"{_secs(split.to_cuda)}  {_secs(split.to_pg)}  {_secs(split.to_first_step):>10}  "
            f"{_secs(own)}"
        )


def _secs(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>7.2f}s"
