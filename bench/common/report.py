"""Statistics, ratios and tables; the machine line under them; progress on stderr."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Stats:
    median: float
    low: float
    high: float
    n: int

    @staticmethod
    def of(values: Sequence[float | None]) -> Stats | None:
        clean = [v for v in values if v is not None]
        if not clean:
            return None
        return Stats(statistics.median(clean), min(clean), max(clean), len(clean))

    def cell(self, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(self.median)} ({fmt.format(self.low)}-{fmt.format(self.high)})"


def ratio(a: Stats | None, b: Stats | None) -> float | None:
    if a is None or b is None or b.median <= 0:
        return None
    return a.median / b.median


def pair_ratios(ours: dict[int, float | None], peer: dict[int, float | None]) -> list[float]:
    """Our run i / the peer's run i, for the runs where both have a figure."""
    ratios = []
    for run, value in sorted(ours.items()):
        other = peer.get(run)
        if value is not None and other:
            ratios.append(value / other)
    return ratios


def ratio_cell(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    text = f"{statistics.median(ratios):.2f}"
    return text + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """A plain aligned table, or a GitHub-markdown one."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), *(fmt.format(*row) for row in rows)])


def load_average() -> str:
    """The 1-minute load average: the machine is shared, so results say how busy it was."""
    return f"{os.getloadavg()[0]:.1f}"


def machine_line(load_before: str) -> str:
    load = f"1-min load average {load_before} at start, {load_average()} at end"
    return f"machine: {os.cpu_count()} cores; {load}"


def progress(message: str) -> None:
    """Progress goes to stderr so stdout stays the table."""
    print(message, file=sys.stderr, flush=True)
