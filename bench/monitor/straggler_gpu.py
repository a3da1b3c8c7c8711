"""The straggler detector's CUDA path on one GPU: CPU cost per section, with and without
torch.profiler running, next to the raw cost of the CUDA calls it makes.

Usage (a CUDA machine): python -m bench.monitor.straggler_gpu [--entries 20000] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.common import smoke
from bench.common.timing import per_call_us
from ftrun.straggler import Detector

ENTRIES = 20_000  # calls per timed batch (--entries)


def us_per_call(body: Callable[[], Any], entries: int, repeats: int = 5) -> float:
    """Median over `repeats` batches, net of the loop; the device drained between them."""
    costs = per_call_us(body, repeats, entries, between=torch.cuda.synchronize,
                        net_of_loop=True)  # fmt: skip
    return statistics.median(costs)


def section() -> None:
    with Detector.detection_section("s"):
        pass


def cpu_section() -> None:
    with Detector.detection_section("c", profile_cuda=False):
        pass


def figures(entries: int) -> dict[str, float]:
    event = torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream()
    cuda = Detector._state.recorder.cuda
    return {
        f"section events: {type(cuda.events).__name__}": 0.0,
        "event.record()": us_per_call(event.record, entries),
        "event.record(stream)": us_per_call(lambda: event.record(stream), entries),
        "current_stream()": us_per_call(torch.cuda.current_stream, entries),
        "section, CUDA": us_per_call(section, entries),
        "section, CPU only": us_per_call(cpu_section, entries),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=ENTRIES, help="calls per batch")
    entries = smoke.parse_args(parser, {"entries": 100}).entries
    if not smoke.cuda_available():
        smoke.skip_gpu("straggler_gpu", "every figure (they are all CUDA's)")
        return
    for name in ("FTRUN_MONITOR_ADDR", "FTRUN_IPC_DIR"):
        os.environ.pop(name, None)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    Detector.initialize()
    plain = figures(entries)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities):
        profiled = figures(entries)
    Detector.shutdown()
    print(f"{'us per call':24} {'alone':>8} {'profiler':>9}")
    for name in plain:
        print(f"{name:24} {plain[name]:8.2f} {profiled[name]:9.2f}")


if __name__ == "__main__":
    main()
