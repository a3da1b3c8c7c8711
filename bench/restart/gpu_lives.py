"""The GPU benches' rank logs (`bench/workers/gpu_user_worker.py`'s lines): each rank's
processes, their marks and steps, and what they say of a job's start-up and its restarts."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from bench.common.logs import parse_step_line

MARKS = ("script", "cuda", "pg", "load", "ddp", "opt", "ready")
"""A restart's split, in the order the marks happen."""


@dataclasses.dataclass
class Life:
    """One worker process, from its lines: its marks, first step, last step, crash."""

    pid: int
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    first_step: float | None = None
    last_step: int = 0
    fault: tuple[int, float] | None = None  # (step, wall clock)


def read_lives(out: Path, rank: int = 0) -> list[Life]:
    """One rank's processes in the order they first logged (complete lines only)."""
    path = out / f"rank{rank}.log"
    lives: dict[int, Life] = {}
    lines = path.read_text(errors="replace").split("\n")[:-1] if path.exists() else []
    for line in lines:
        step = parse_step_line(line)
        if step is None:
            _add_mark(lives, line)
            continue
        life = lives.setdefault(step.pid, Life(step.pid))
        if step.fault:
            life.fault = (step.step, step.ts)
        else:
            life.first_step = life.first_step or step.ts
            life.last_step = max(life.last_step, step.step)
    return list(lives.values())


def _add_mark(lives: dict[int, Life], line: str) -> None:
    """`<ts> rank= pid= mark=<name> [proc=<ts>]`; `start` is recorded as `script`, at the
    process's start (`proc`) when the worker could read it."""
    fields = line.split()
    with contextlib.suppress(ValueError, KeyError, IndexError):
        values = dict(field.split("=", 1) for field in fields[1:] if "=" in field)
        mark, pid = values["mark"], int(values["pid"])
        name, ts = mark, float(fields[0])
        if mark == "start":
            name, ts = "script", float(values.get("proc", ts))
        lives.setdefault(pid, Life(pid)).marks[name] = ts


def _since(ts: float | None, origin: float) -> float | None:
    return None if ts is None else ts - origin


def measures(
    lives: Sequence[Sequence[Life]], launched_at: float, crashes: tuple[int, int]
) -> dict[str, float | None]:
    """`lives`: each rank's; `crashes`: the early and late crash steps. Startup: the last
    rank's first step; a restart: its slowest rank."""
    firsts = [ranks[0].first_step if ranks else None for ranks in lives]
    found: dict[str, float | None] = {"startup": None}
    if firsts and None not in firsts:
        found["startup"] = max(f for f in firsts if f is not None) - launched_at
    for name, step in zip(("early", "late"), crashes, strict=True):
        found.update(restart(lives, name, step))
    return found


def restart(lives: Sequence[Sequence[Life]], name: str, step: int) -> dict[str, float | None]:
    """The crash at `step` (in any rank) -> the next processes' marks and first step (`name`),
    cumulative, of the rank whose first step came last."""
    found: dict[str, float | None] = dict.fromkeys([name, *(f"{name}.to_{m}" for m in MARKS)])
    crashes = [life.fault[1] for ranks in lives for life in ranks
               if life.fault and life.fault[0] == step]  # fmt: skip
    if not crashes:
        return found
    crash_ts = min(crashes)
    successors = []
    for ranks in lives:  # a life whose first step follows the crash is a new process
        successor = next((life for life in ranks if (life.first_step or 0) > crash_ts), None)
        if successor is None:
            return found  # a rank that never stepped again: no figure
        successors.append(successor)
    slowest = max(successors, key=lambda life: life.first_step or 0)
    found[name] = _since(slowest.first_step, crash_ts)
    found.update({f"{name}.to_{m}": _since(slowest.marks.get(m), crash_ts) for m in MARKS})
    return found
