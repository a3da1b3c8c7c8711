"""The straggler detector's CUDA path on one GPU: CPU cost per section, with and without
torch.profiler running, next to the raw cost of the CUDA calls it makes.

Usage (a CUDA machine): python bench/monitor/straggler_gpu.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ftrun.straggler import Detector

ENTRIES = 20_000


def per_call_us(body, entries: int = ENTRIES, repeats: int = 5) -> float:
    results = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(entries):
            pass
        empty = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for _ in range(entries):
            body()
        results.append((time.perf_counter_ns() - start - empty) / entries / 1e3)
        torch.cuda.synchronize()
    return statistics.median(results)


def section() -> None:
    with Detector.detection_section("s"):
        pass


def cpu_section() -> None:
    with Detector.detection_section("c", profile_cuda=False):
        pass


def figures() -> dict[str, float]:
    event = torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream()
    cuda = Detector._state.recorder.cuda
    return {
        f"section events: {type(cuda.events).__name__}": 0.0,
        "event.record()": per_call_us(event.record),
        "event.record(stream)": per_call_us(lambda: event.record(stream)),
        "current_stream()": per_call_us(torch.cuda.current_stream),
        "section, CUDA": per_call_us(section),
        "section, CPU only": per_call_us(cpu_section),
    }


def main() -> None:
    for name in ("FTRUN_MONITOR_ADDR", "FTRUN_IPC_DIR"):
        os.environ.pop(name, None)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    Detector.initialize()
    plain = figures()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities):
        profiled = figures()
    Detector.shutdown()
    print(f"{'us per call':24} {'alone':>8} {'profiler':>9}")
    for name in plain:
        print(f"{name:24} {plain[name]:8.2f} {profiled[name]:9.2f}")


if __name__ == "__main__":
    main()
