"""Waiting, after a stop, until the stopped workers' GPU memory is really free.

A CUDA context outlives its process by a moment (the driver tears it down), and a new worker
that allocates before that may run out of memory or share a GPU with a zombie context. The
agent records each GPU's memory in use before the first workers start; after a stop it waits
until no stopped pid holds a GPU and each GPU is back within a tolerance of that baseline, not
counting what the agent's own kept processes hold (prestarted workers' contexts, about
0.5 GiB a GPU: more than the default tolerance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ftrun.nvml import nvml_session
from ftrun.rendezvous.ranks import Round
from ftrun.services import Emit, NodeService

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
    with nvml_session() as nvml:
        if nvml is None:
            return None
        return {i: _used(nvml, i) for i in range(nvml.nvmlDeviceGetCount())}


def wait_until_released(
    baseline: dict[int, int],
    pids: Collection[int],
    timeout: float,
    tolerance_mb: float,
    kept: Collection[int] = (),
) -> Reclaim:
    """`kept`: the agent's own processes that hold GPU memory on purpose (prestarted workers):
    theirs does not count against the baseline."""
    started = time.monotonic()
    with nvml_session() as nvml:
        while nvml is not None:
            holders, excess = still_held(nvml, baseline, set(pids), set(kept))
            released = not holders and excess <= tolerance_mb
            elapsed = time.monotonic() - started
            if released or elapsed >= timeout:
                return Reclaim(elapsed, released, 0.0 if released else excess)
            time.sleep(_POLL_S)
    return Reclaim(0.0, True, 0.0)


def still_held(
    nvml: Any, baseline: dict[int, int], pids: set[int], kept: set[int]
) -> tuple[set[int], float]:
    """The stopped `pids` that still hold a GPU, and the largest excess (MB) over a GPU's
    baseline, less what the `kept` processes hold."""
    holders: set[int] = set()
    excess = 0.0
    for index, before in baseline.items():
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        kept_bytes = 0
        # Some containers hide processes: the memory figure still tells.
        with contextlib.suppress(nvml.NVMLError):
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            holders |= {p.pid for p in running} & pids
            kept_bytes = sum(p.usedGpuMemory or 0 for p in running if p.pid in kept)
        excess = max(excess, (_used(nvml, index) - kept_bytes - before) / _MB)
    return holders, excess


def _used(nvml: Any, index: int) -> int:
    return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index)).used)


class GpuReclaimService(NodeService):
    """Before a restart, waits (bounded) until the stopped workers' GPU memory is free."""

    name = "GPU memory reclaim"

    def __init__(
        self, timeout: float, tolerance_mb: float, emit: Emit,
        kept: Callable[[], Collection[int]] = tuple,
    ) -> None:  # fmt: skip
        self._timeout = timeout
        self._tolerance_mb = tolerance_mb
        self._emit = emit
        self._kept = kept
        self._baseline = memory_baseline()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        if self._baseline is None:
            return
        reclaim = wait_until_released(
            self._baseline, list(pids), self._timeout, self._tolerance_mb, self._kept()
        )
        self._emit("gpu_memory_reclaimed", duration=round(reclaim.duration, 6),
                   released=reclaim.released, excess_mb=round(reclaim.excess_mb, 1))  # fmt: skip
        if reclaim.released:
            log.info("GPU memory of the stopped workers released in %.3fs", reclaim.duration)
        else:
            log.warning(
                "GPU memory still %.0f MB above its baseline after %.1fs; starting anyway",
                reclaim.excess_mb, reclaim.duration,
            )  # fmt: skip
