"""A gloo rank that all_reduces every step under the monitor client.

--skip CYCLE:RANK:STEP: that rank skips the step's all_reduce and goes on heartbeating without
any collective (as a rank that went off to do something else would), so the other ranks hang
inside the collective (gloo, or NCCL with --backend nccl). --stop CYCLE:RANK:STEP: at the start of
the step that rank writes the time to <ckpt-dir>/stopped-rank<R>.txt and SIGSTOPs itself (as
NVRx's examples simulate a hung rank): it can act on no signal but SIGKILL.
<ckpt-dir>/progress-rank<R>.txt gets "<cycle> <step> <time>" after each step.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun.client_lib import RankMonitorClient

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--skip", default="", metavar="CYCLE:RANK:STEP")
    parser.add_argument("--stop", default="", metavar="CYCLE:RANK:STEP")
    parser.add_argument("--backend", default="gloo", help="nccl: one GPU per local rank")
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    skip = tuple(int(x) for x in args.skip.split(":")) if args.skip else None
    stop = tuple(int(x) for x in args.stop.split(":")) if args.stop else None
    client = RankMonitorClient()
    client.init_workload_monitoring()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    progress = (args.ckpt_dir / f"progress-rank{rank}.txt").open("a")
    grads = torch.ones(64, device=device)
    for step in range(1, args.steps + 1):
        if skip == (CYCLE, rank, step):
            print(f"rank {rank}: skipping the all_reduce of step {step}", flush=True)
            while True:
                client.send_heartbeat()
                time.sleep(0.1)
        if stop == (CYCLE, rank, step):
            (args.ckpt_dir / f"stopped-rank{rank}.txt").write_text(f"{time.time():.6f}\n")
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(grads)
        float(grads[0])  # the step reads its result (a loss.item()): NCCL's wait happens here
        grads.fill_(1.0)
        time.sleep(args.step_time)
        client.send_heartbeat(step)
        progress.write(f"{CYCLE} {step} {time.time():.6f}\n")
        progress.flush()
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
