"""`StopVote`: the ranks agree, at the same step end, that one of them asked to stop.

Used by `PreemptionCallback` (a rank saw SIGTERM) and `StragglerDetectionCallback` (rank 0 saw
stragglers, with `stop_if_detected`). Lightning stops a fit when `trainer.should_stop` is set,
but every rank must set it at the same step, and the ranks learn things at different moments.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

_MAX_STEPS_BETWEEN_VOTES = 1000


class StopVote:
    """Whether any rank asked to stop, agreed by all ranks at the same step.

    A vote is an all-reduce (MAX) of [asked, K] on a gloo group of the voters' own, issued at a
    step end and read K steps later (K agreed in the previous vote), so it overlaps training and
    never waits on a peer. Each rank proposes K = `period` / its recent step time: the ranks
    agree about every `period` seconds, and every step when steps are longer than that.
    """

    def __init__(self, period: float) -> None:
        self.period = period
        self._group: Any = None
        self._work: Any = None
        self._payload = torch.zeros(2, dtype=torch.int64)
        self._read_at = 0
        self._last_end: float | None = None
        self._step_time = period

    def open(self) -> None:
        self._read_at, self._last_end = 0, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    def poll(self, step: int, asked: bool) -> bool:
        """Every rank calls this once per step end, with its own `asked`; all get the same
        answer at the same step."""
        self._measure()
        if self._group is None:
            return asked
        if step < self._read_at:
            return False
        every = 1
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._payload[0].item() > 0:
                return True
            every = int(self._payload[1].item())
        proposal = min(_MAX_STEPS_BETWEEN_VOTES, max(1, int(self.period / self._step_time)))
        self._payload[0], self._payload[1] = int(asked), proposal
        self._work = dist.all_reduce(
            self._payload, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        self._read_at = step + every
        return False

    def close(self, drain: bool) -> None:
        """`drain`: wait for the vote in flight (every rank issued it); not after a failure."""
        if self._work is not None and drain:
            self._work.wait()
        self._work = None
        self._group = None

    def _measure(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:  # an average over ~10 steps, robust to one slow step
            self._step_time += (now - self._last_end - self._step_time) / 10
        self._last_end = now
