"""The training-path half of the detector: sections record durations, batches leave later.

A section is a reused context-manager object per (name, profile_cuda): entering it reads
`perf_counter_ns` (and, for a CUDA section, records a CUDA event on the current stream);
leaving it appends the CPU duration to a list, and once per `flush_every_ns` hands every
section's new durations to the sinks in one batch (under the launcher the monitor channel, one
non-blocking send, and the local copy). CUDA events are resolved at that flush with `query()`:
an event the GPU has not reached yet waits for a later flush; nothing ever synchronizes the
stream.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ftrun.straggler.cuda import CudaTimer

Batch = list[tuple[str, bool, list[int]]]
"""(section name, gpu, durations in ns) for every section that has new durations."""
FLUSH_EVERY_S = 0.25

_now = time.perf_counter_ns


class Sink(Protocol):
    def take(self, batch: Batch) -> None: ...


class Section(contextlib.ContextDecorator):
    """One named section; entries may nest (a stack of start times)."""

    __slots__ = ("_cuda", "_interval", "_recorder", "_starts", "cpu", "entries", "gpu", "name")

    def __init__(self, name: str, interval: int, cuda: CudaTimer | None, recorder: Recorder):
        self.name = name
        self.cpu: list[int] = []
        self.gpu: list[int] = []
        self.entries = 0
        self._starts: list[Any] = []
        self._interval = interval
        self._cuda = cuda
        self._recorder = recorder

    def __enter__(self) -> Section:
        entry = self.entries
        self.entries = entry + 1
        if entry % self._interval:
            self._starts.append(None)  # not profiled this time (profiling_interval)
        elif self._cuda is None:
            self._starts.append(_now())
        else:
            self._starts.append((self._cuda.start(), _now()))
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        end = _now()
        start = self._starts.pop()
        if start is None or exc_type is not None:
            return  # a failed entry is not a duration (as NVRx)
        if self._cuda is None:
            self.cpu.append(end - start)
        else:
            event, cpu_start = start
            self.cpu.append(end - cpu_start)
            self._cuda.stop(self, event)
        recorder = self._recorder
        if end >= recorder.next_flush:
            recorder.flush(end)


class Recorder:
    """Every section of this process, and where their batches go (each sink takes each)."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        interval: int = 1,
        cuda: CudaTimer | None = None,
        flush_every_s: float = FLUSH_EVERY_S,
        clock: Callable[[], int] = _now,
    ) -> None:
        self.sinks = sinks
        self.interval = max(1, int(interval))
        self.cuda = cuda
        self.sections: dict[tuple[str, bool], Section] = {}
        self._flush_every = int(flush_every_s * 1e9)
        self._clock = clock
        self.next_flush = clock() + self._flush_every

    def section(self, name: str, profile_cuda: bool) -> Section:
        key = (name, profile_cuda)
        if key not in self.sections:
            cuda = self.cuda if profile_cuda else None
            self.sections[key] = Section(name, self.interval, cuda, self)
        return self.sections[key]

    def flush(self, now: int | None = None) -> None:
        """Hand the sink what was recorded since the last flush (CUDA: what completed)."""
        now = self._clock() if now is None else now
        self.next_flush = now + self._flush_every
        if self.cuda is not None:
            self.cuda.resolve()
        batch: Batch = []
        for section in self.sections.values():
            if section.cpu:
                batch.append((section.name, False, section.cpu))
                section.cpu = []
            if section.gpu:
                batch.append((section.name, True, section.gpu))
                section.gpu = []
        if batch:
            for sink in self.sinks:
                sink.take(batch)


def merge(batches: Sequence[Batch]) -> dict[tuple[str, bool], list[int]]:
    """Batches as one list of durations per (section, gpu)."""
    merged: dict[tuple[str, bool], list[int]] = {}
    for batch in batches:
        for name, gpu, durations in batch:
            merged.setdefault((name, gpu), []).extend(durations)
    return merged
