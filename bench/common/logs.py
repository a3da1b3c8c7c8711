"""The workers' log lines, as the benches read them back (complete lines only: a line still
being written, without its newline, is left out)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from .jobs import WORLD

# ---- bench/workers/user_worker.py --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepLine:
    """A line of `user_worker.py`: a finished step, or (`fault` set) a fault about to fire."""

    ts: float
    rank: int
    pid: int
    step: int
    fault: str | None = None


def parse_step_line(line: str) -> StepLine | None:
    """`<ts> rank=<r> pid=<pid> step=<n> loss=<x>|fault=<kind>`; None for anything else."""
    fields = line.split()
    with contextlib.suppress(ValueError, KeyError, IndexError):
        values = dict(field.split("=", 1) for field in fields[1:] if "=" in field)
        return StepLine(
            float(fields[0]),
            int(values["rank"]),
            int(values["pid"]),
            int(values["step"]),
            values.get("fault"),
        )
    return None


def _complete_lines(out: Path, rank: int) -> list[str]:
    path = out / f"rank{rank}.log"
    return path.read_text(errors="replace").split("\n")[:-1] if path.exists() else []


def read_steps(out: Path, rank: int) -> list[StepLine]:
    """A rank's step and fault lines."""
    return [r for r in map(parse_step_line, _complete_lines(out, rank)) if r is not None]


def user_fault(out: Path) -> StepLine | None:
    """The job's injected fault (the earliest fault line)."""
    faults = [r for rank in range(WORLD) for r in read_steps(out, rank) if r.fault]
    return min(faults, key=lambda r: r.ts, default=None)


def user_pids(out: Path, until: float | None = None, world: int = WORLD) -> set[int]:
    """Processes that logged a line (at or before `until`)."""
    return {
        r.pid
        for rank in range(world)
        for r in read_steps(out, rank)
        if until is None or r.ts <= until
    }


def user_all_stepping(
    out: Path, since: float = 0.0, old_pids: frozenset[int] = frozenset(), world: int = WORLD
) -> float | None:
    """When the last of `world` ranks finished its first step after `since` in a process not in
    `old_pids`."""
    times = []
    for rank in range(world):
        first = next(
            (
                r.ts
                for r in read_steps(out, rank)
                if not r.fault and r.ts > since and r.pid not in old_pids
            ),
            None,
        )
        if first is None:
            return None
        times.append(first)
    return max(times)


# ---- bench/workers/ettr_worker.py --------------------------------------------------------------

WARM_SAVES = 3


@dataclasses.dataclass(frozen=True)
class Line:
    ts: float
    pid: int
    kind: str  # step | save | restore
    step: int
    seconds: float = 0.0


def read_lines(out: Path, rank: int) -> list[Line]:
    lines = []
    for text in _complete_lines(out, rank):
        fields = text.split()
        values = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        for kind, extra in (("step", None), ("save", "stall"), ("restore", "took")):
            if kind in values:
                seconds = float(values[extra]) if extra else 0.0
                lines.append(
                    Line(float(fields[0]), int(values["pid"]), kind, int(values[kind]), seconds)
                )
    return lines


def steady_stalls(lines: Sequence[Line]) -> list[float]:
    """Save stalls, less each process's first `WARM_SAVES` (a new process pays for new memory
    until its saves reuse retired ones, which the measured runs count where it happens)."""
    seen: collections.Counter[int] = collections.Counter()
    stalls = []
    for line in lines:
        if line.kind == "save":
            if seen[line.pid] >= WARM_SAVES:
                stalls.append(line.seconds)
            seen[line.pid] += 1
    return stalls
