"""Cost of the in-worker hot path: send_heartbeat() and a start/end section pair.

Runs a real RankMonitorServer here and a real rank in a child process (the timing happens in
the child, as it would in training); prints the median per-call cost over batches.

    python -m bench.monitor.heartbeat [--batches 50] [--batch 2000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from bench.common import ROOT, smoke
from ftrun.rank_monitor import RankMonitorConfig, RankMonitorServer

RANK_CODE = textwrap.dedent(
    """
    import json, statistics, sys, time
    from bench.common.timing import per_call_us
    from ftrun.client_lib import RankMonitorClient
    batches, batch = int(sys.argv[1]), int(sys.argv[2])
    client = RankMonitorClient()
    client.init_workload_monitoring()
    def per_call(fn):
        # the pause lets the server drain, as between training steps
        pause = lambda: time.sleep(0.002)
        return statistics.median(per_call_us(fn, batches, batch, between=pause))
    def section():
        client.start_section("step")
        client.end_section("step")
    result = {"send_heartbeat": per_call(client.send_heartbeat), "section pair": per_call(section)}
    print(json.dumps(result))
    client.shutdown_workload_monitoring()
    """
)
TARGETS_US = {"send_heartbeat": 5.0, "section pair": 10.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50, help="timed batches per call")
    parser.add_argument("--batch", type=int, default=2000, help="calls per batch")
    args = smoke.parse_args(parser, {"batches": 2, "batch": 50})
    config = RankMonitorConfig(rank_section_timeouts={"step": 60.0})
    with (
        tempfile.TemporaryDirectory() as tmp,
        RankMonitorServer(config, job_dir=Path(tmp) / "job") as server,
    ):
        proc = subprocess.Popen(
            [sys.executable, "-c", RANK_CODE, str(args.batches), str(args.batch)],
            env={**server.worker_env(), "RANK": "0"},
            cwd=ROOT,  # where `bench` imports from
            stdout=subprocess.PIPE,
            text=True,
        )
        server.expect_rank(0, proc.pid)
        out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        sys.exit(f"bench rank failed with {proc.returncode}")
    results = json.loads(out)
    print(f"{'call':<16}{'median us':>10}{'target us':>11}  ok")
    for name, cost in results.items():
        target = TARGETS_US[name]
        print(f"{name:<16}{cost:>10.2f}{target:>11.1f}  {'yes' if cost <= target else 'NO'}")


if __name__ == "__main__":
    main()
