"""The GPU memory reclaim's decision (agent/node_services/gpu_memory.py) against a fake NVML
view: what the stopped workers and the agent's kept processes hold."""

from __future__ import annotations

import dataclasses

from ftrun.agent.node_services.gpu_memory import still_held

MB = 1024 * 1024


@dataclasses.dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


class Nvml:
    NVMLError = RuntimeError

    def __init__(self, used: dict[int, int], running: dict[int, list[Proc]] | None) -> None:
        self.used, self.running = used, running

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Proc]:
        if self.running is None:
            raise RuntimeError("hidden in this container")
        return self.running.get(handle, [])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        return type("Memory", (), {"used": self.used[handle]})()


BASELINE = {0: 1000 * MB, 1: 1000 * MB}


def test_a_prestarted_workers_context_is_not_the_stopped_workers_memory() -> None:
    nvml = Nvml({0: 1000 * MB, 1: 1520 * MB}, {1: [Proc(77, 520 * MB)]})
    assert still_held(nvml, BASELINE, {11, 12}, kept={77}) == (set(), 0.0)
    holders, excess = still_held(nvml, BASELINE, {11, 12}, kept=set())
    assert holders == set() and excess == 520  # without it: above the 512 MB tolerance


def test_a_stopped_worker_still_listed_holds_its_gpu() -> None:
    nvml = Nvml({0: 5000 * MB, 1: 1520 * MB}, {0: [Proc(11, 4000 * MB)], 1: [Proc(77, None)]})
    holders, excess = still_held(nvml, BASELINE, {11, 12}, kept={77})
    assert holders == {11} and excess == 4000


def test_hidden_processes_leave_the_memory_figure_alone() -> None:
    nvml = Nvml({0: 1000 * MB, 1: 1100 * MB}, None)
    assert still_held(nvml, BASELINE, {11}, kept={77}) == (set(), 100)
