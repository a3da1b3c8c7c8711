"""Cost of the in-worker hot path: send_heartbeat() and a start/end section pair.

Runs a real RankMonitorServer here and a real rank in a child process (the timing happens in
the child, as it would in training); prints the median per-call cost over batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from ftrun.rank_monitor import RankMonitorConfig, RankMonitorServer

RANK_CODE = textwrap.dedent(
    """
    import json, statistics, time
    from ftrun.client_lib import RankMonitorClient
    client = RankMonitorClient()
    client.init_workload_monitoring()
    def per_call(fn, batch=2000, batches=50):
        costs = []
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            costs.append((time.perf_counter() - start) / batch)
            time.sleep(0.002)  # let the server drain, as between training steps
        return statistics.median(costs) * 1e6
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
    config = RankMonitorConfig(rank_section_timeouts={"step": 60.0})
    with (
        tempfile.TemporaryDirectory() as tmp,
        RankMonitorServer(config, job_dir=Path(tmp) / "job") as server,
    ):
        proc = subprocess.Popen(
            [sys.executable, "-c", RANK_CODE],
            env={**server.worker_env(), "RANK": "0"},
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
