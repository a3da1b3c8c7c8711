"""What one health-watch poll costs on a real GPU: every NVML reading the agent's watch takes
while training (`ftrun.agent.node_services.health_watch`), timed as the watch takes it, and
each call alone.

Runs on the device (real NVML); here, without a driver, it says so and exits 0. Prints a
markdown table: per poll and per call, the median and 99th percentile in microseconds, and the
CPU share of one core that a poll every `--interval` seconds costs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

from bench.common import smoke
from bench.common.timing import p99, per_call_us
from ftrun.agent.node_services.health_watch import HealthWatch
from ftrun.config.agent import HealthCheckConfig
from ftrun.nvml import load_nvml


def row(name: str, costs: list[float]) -> str:
    return f"| {name} | {statistics.median(costs):.1f} | {p99(costs):.1f} |"


def single_calls(nvml: Any, count: int) -> list[str]:
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    events = nvml.nvmlEventSetCreate()

    def ecc() -> Any:
        kind, counter = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        return nvml.nvmlDeviceGetTotalEccErrors(handle, kind, counter)

    queries: dict[str, Callable[[], Any]] = {
        "nvmlEventSetWait_v2 (nothing pending)": lambda: nvml.nvmlEventSetWait_v2(events, 0),
        "nvmlDeviceGetTotalEccErrors": ecc,
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda: (
            nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
        ),
        "nvmlDeviceGetRemappedRows": lambda: nvml.nvmlDeviceGetRemappedRows(handle),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda: (
            nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        ),
    }
    calls = {name: (lambda q=query: _quiet(nvml, q)) for name, query in queries.items()}
    return [row(name, per_call_us(call, count)) for name, call in calls.items()]


def _quiet(nvml: Any, call: Callable[[], Any]) -> None:
    with contextlib.suppress(nvml.NVMLError):
        call()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--interval", type=float, default=5.0, help="the watch's interval")
    args = smoke.parse_args(parser, {"polls": 5})
    nvml = load_nvml()
    if nvml is None:
        smoke.skip_gpu("health_watch", "every reading (no NVML, no driver: run it on the device)")
        return 0
    gpus = nvml.nvmlDeviceGetCount()
    watch = HealthWatch(HealthCheckConfig(watch_interval=args.interval), lambda *a, **k: None,
                        lambda item: None)  # fmt: skip
    watch.begin_cycle()
    polls = per_call_us(watch.poll, args.polls)
    print(f"{gpus} GPU(s), driver {nvml.nvmlSystemGetDriverVersion()}, {args.polls} polls")
    print()
    print("| reading | median (us) | p99 (us) |")
    print("|---|---|---|")
    print(row(f"one poll (every reading of {gpus} GPU(s))", polls))
    for line in single_calls(nvml, args.polls):
        print(line)
    share = statistics.median(polls) / 1e6 / args.interval * 100
    print()
    print(f"CPU: a poll every {args.interval:g} s is {share:.5f} % of one core (median poll)")
    watch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
