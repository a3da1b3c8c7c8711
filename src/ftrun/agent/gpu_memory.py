"""Waiting, after a stop, until the stopped workers' GPU memory is really free.

A CUDA context outlives its process by a moment (the driver tears it down), and a new worker
that allocates before that may run out of memory or share a GPU with a zombie context. The
agent records each GPU's memory in use before the first workers start; after a stop it waits
until no stopped pid holds a GPU and each GPU is back within a tolerance of that baseline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection
from typing import Any

log = logging.getLogger("ftrun.agent")
_POLL_S = 0.05
_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Reclaim:
    duration: float
    released: bool
    excess_mb: float
    """Largest per-GPU memory above the baseline at the end (0 when released)."""


def memory_baseline() -> dict[int, int] | None:
    """Bytes in use per GPU now, or None when there is no NVML (no GPUs: nothing to wait for)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return {i: _used(nvml, i) for i in range(nvml.nvmlDeviceGetCount())}
    finally:
        nvml.nvmlShutdown()


def wait_until_released(
    baseline: dict[int, int], pids: Collection[int], timeout: float, tolerance_mb: float
) -> Reclaim:
    nvml = _nvml()
    started = time.monotonic()
    if nvml is None:
        return Reclaim(0.0, True, 0.0)
    try:
        while True:
            holders, excess = _still_held(nvml, baseline, set(pids))
            released = not holders and excess <= tolerance_mb
            elapsed = time.monotonic() - started
            if released or elapsed >= timeout:
                return Reclaim(elapsed, released, 0.0 if released else excess)
            time.sleep(_POLL_S)
    finally:
        nvml.nvmlShutdown()


def _still_held(nvml: Any, baseline: dict[int, int], pids: set[int]) -> tuple[set[int], float]:
    holders: set[int] = set()
    excess = 0.0
    for index, before in baseline.items():
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            holders |= {p.pid for p in running} & pids
        except nvml.NVMLError:
            pass  # some containers hide processes: the memory figure still tells
        excess = max(excess, (_used(nvml, index) - before) / _MB)
    return holders, excess


def _used(nvml: Any, index: int) -> int:
    return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index)).used)


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None
