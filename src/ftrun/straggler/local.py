"""The detector without a launcher (plain torchrun, or one process): scores computed in-process.

Durations stay in the process (`LocalSink`; under the launcher a copy of them, for NVRx's
`generate_report()`, which computes now). `local_report` summarises this rank's interval
and, when a torch.distributed process group is initialized with more than one rank, exchanges
the ranks' records with one `all_gather_object` so that relative scores compare every rank
(every rank must then call `generate_report` at the same step, as with NVRx). Without a group,
the report holds this rank alone: its relative scores are 1.0 by definition.

`IntervalTracker` is what `generate_report_if_interval_elapsed` needs here: ranks must agree on
*which step* reports, so the interval is a number of steps, estimated from the first steps'
times and agreed on once with an all-reduce (the largest), as NVRx does. Under the launcher
it does not run: the agents report on their own clock.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

from ftrun.straggler.assemble import RankRecord, assemble, rank_record
from ftrun.straggler.recorder import Batch, merge
from ftrun.straggler.report import Report
from ftrun.straggler.scores import History
from ftrun.straggler.statistics import Statistic

ESTIMATION_STEPS = 16


KEPT_PER_SECTION = 100_000
"""Under the launcher nobody may ask for an in-process report: beyond this many durations per
section the oldest are dropped, so that memory stays bounded (about 0.8 MB per section)."""


class LocalSink:
    """Keeps the batches in the process until the next report."""

    def __init__(self, compact_every: int = 1024) -> None:
        self.batches: list[Batch] = []
        self._compact_every = compact_every

    def take(self, batch: Batch) -> None:
        self.batches.append(batch)
        if len(self.batches) >= self._compact_every:
            merged = merge(self.batches)
            self.batches = [[(n, g, d[-KEPT_PER_SECTION:]) for (n, g), d in merged.items()]]

    def drain(self) -> dict[tuple[str, bool], list[int]]:
        batches, self.batches = self.batches, []
        return merge(batches)


def initialized_dist() -> Any:
    """torch.distributed if the script imported torch and initialized a process group, else
    None (this never imports torch)."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _group() -> Any:
    """torch.distributed if a process group of more than one rank is initialized, else None."""
    dist = initialized_dist()
    return dist if dist is not None and dist.get_world_size() > 1 else None


def local_report(sink: LocalSink, rank: int, node: str, history: History) -> Report:
    """This interval's report from this process's durations (and the other ranks', if any)."""
    durations = sink.drain()
    mine = rank_record(rank, node, durations, history)
    dist = _group()
    records: dict[int, RankRecord] = {rank: mine}
    if dist is not None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (rank, mine))
        records = dict(gathered)
    report = assemble(records)
    cpu = {name: durations[name, False] for name, gpu in durations if not gpu}
    gpu = {name: durations[name, True] for name, on in durations if on}
    return dataclasses.replace(
        report, local_section_summaries=_stats(cpu), local_kernel_summaries=_stats(gpu)
    )


def _stats(durations: Mapping[str, list[int]]) -> dict[str, dict[Statistic, float]]:
    """NVRx's per-section statistics, in milliseconds."""
    found = {}
    for name, values in durations.items():
        ms = [v * 1e-6 for v in values]
        found[name] = {
            Statistic.MIN: min(ms),
            Statistic.MAX: max(ms),
            Statistic.MED: statistics.median(ms),
            Statistic.AVG: statistics.fmean(ms),
            Statistic.STD: statistics.stdev(ms) if len(ms) > 1 else math.nan,
            Statistic.NUM: len(ms),
        }
    return found


@dataclasses.dataclass
class IntervalTracker:
    """Steps between reports: `time_interval` / the median step time of the first steps."""

    time_interval: float
    profiling_interval: int = 1
    step: int = 0
    every: int | None = None
    _last: float | None = None
    _times: list[float] = dataclasses.field(default_factory=list)

    def tick(self, now: float | None = None) -> bool:
        """Count one step; True when this step reports."""
        now = time.monotonic() if now is None else now
        self.step += 1
        if self.every is None:
            if self._last is not None:
                self._times.append(now - self._last)
            self._last = now
            if len(self._times) >= ESTIMATION_STEPS:
                self.every = self._agree(
                    self.time_interval / max(statistics.median(self._times), 1e-9)
                )
        return self.elapsed()

    def elapsed(self) -> bool:
        return self.every is not None and self.step % self.every == 0

    def _agree(self, steps: float) -> int:
        dist = _group()
        if dist is not None:
            import torch

            value = torch.tensor([steps], dtype=torch.float64)
            if dist.get_backend() == "nccl":
                value = value.cuda()
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            steps = float(value.item())
        return max(int(steps), self.profiling_interval, 1)
