"""A plain gloo training loop that reports iterations and, on request, asks its agent for a
workload action; for the hot-spare, progress and control-request tests.

Each step is one all_reduce and a heartbeat with the iteration. Rank 0 writes the last step to
<ckpt-dir>/step every --save-every steps and the others resume from it (a checkpoint), and
writes <ckpt-dir>/FINISHED after --steps.

--stall-at K: every cycle, every rank exits 1 when it reaches iteration K (it never gets past K:
a job that makes no progress). --request ACTION:CYCLE:RANK:STEP: that rank sends
WorkloadControlRequest(ACTION) at STEP of CYCLE, then goes on stepping (the agent decides).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun.client_lib import RankMonitorClient, WorkloadAction, WorkloadControlRequest

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))
RANK = int(os.environ.get("RANK", "0"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--stall-at", type=int, default=0)
    parser.add_argument("--request", default="", metavar="ACTION:CYCLE:RANK:STEP")
    args = parser.parse_args()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    request = args.request.split(":") if args.request else None

    dist.init_process_group("gloo")
    client = RankMonitorClient()
    client.init_workload_monitoring()
    saved = args.ckpt_dir / "step"
    start = int(saved.read_text()) if saved.exists() else 0
    for step in range(start + 1, args.steps + 1):
        if args.stall_at and step >= args.stall_at:
            print(f"rank {RANK}: stalled at {step}", flush=True)
            os._exit(1)
        if request and [CYCLE, RANK, step] == [int(x) for x in request[1:]]:
            action = WorkloadAction[request[0]]
            client.send_workload_control_request(WorkloadControlRequest(action, "test request"))
        value = torch.ones(1)
        dist.all_reduce(value)
        client.send_heartbeat(iteration=step)
        time.sleep(args.step_time)
        if RANK == 0 and step % args.save_every == 0:
            tmp = saved.with_suffix(".tmp")
            tmp.write_text(str(step))
            tmp.replace(saved)
    if RANK == 0:
        (args.ckpt_dir / "FINISHED").touch()
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
