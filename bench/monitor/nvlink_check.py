"""The health watch's NVLink check on this machine's GPUs, once (issue 55's device step): what
it reads (each GPU's NVLinks, their state, their error counters and the tier that read them),
then two polls of the watch itself, `--seconds` apart, and its verdict.

Runs on the device (real NVML); without a driver it says so and exits 0, and a GPU without
NVLink reports "no NVLink" (the check then has nothing to read: that is its answer).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import smoke
from ftrun.agent.node_services.health_watch import HealthFinding, HealthWatch
from ftrun.config.agent import HealthCheckConfig
from ftrun.nvml import nvlink_errors, nvlinks, nvml_session, visible_gpus

TIERS = ("NVLink5 per-link fields", "per-lane fields L0-L5", "nvmlDeviceGetNvLinkErrorCounter")


def describe(nvml: Any) -> int:
    """One line per GPU; returns how many NVLinks the GPUs have."""
    total = 0
    for index, handle in visible_gpus(nvml, None):
        links = nvlinks(nvml, handle)
        total += len(links)
        if not links:
            print(f"GPU {index}: no NVLink")
            continue
        reads = {link: nvlink_errors(nvml, handle, link) for link in links}
        tiers = sorted({TIERS[read[0]] for read in reads.values() if read})
        counters = {link: read[1] for link, read in reads.items() if read}
        print(f"GPU {index}: {len(links)} NVLinks, {sum(links.values())} up; counters read on "
              f"{len(counters)} ({', '.join(tiers) or 'none'}): {counters}")  # fmt: skip
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="between the two polls")
    args = smoke.parse_args(parser, {"seconds": 0.1})
    with nvml_session() as nvml:
        if nvml is None:
            smoke.skip_gpu("nvlink_check", "the NVLink check (no NVML, no driver: on the device)")
            return 0
        links = describe(nvml)
    found: list[HealthFinding] = []
    watch = HealthWatch(HealthCheckConfig(nvlink=True), lambda kind, **f: None, lambda f: None)
    watch.begin_cycle()
    costs = []
    for poll in range(2):
        if poll:
            time.sleep(args.seconds)
        started = time.perf_counter()
        found += watch.poll()
        costs.append((time.perf_counter() - started) * 1e3)
    watch.close()
    nvlink = [f for f in found if f.signature.detail.startswith("NVLink")]
    verdict = "no NVLink" if not links else ("unhealthy" if nvlink else "healthy")
    print(f"polls: {', '.join(f'{c:.2f} ms' for c in costs)}; findings: "
          f"{[f.signature.describe() for f in found] or 'none'}")  # fmt: skip
    print(f"NVLink verdict: {verdict} ({links} links)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
