"""A gloo training loop timed with ftrun.straggler.Detector, for the straggler tests.

Each step: the "step" section (a sleep of --step-time, longer on the slow rank), then one
all_reduce outside it (where the fast ranks wait for the slow one, as in real training).
--slow RANK:FACTOR slows global rank RANK's section by FACTOR in cycle 0 (the job's first).
`--device cuda`: NCCL, and the section is `--gpu-matmuls` products of two 4096 x 4096 matrices
that the section waits for: a GPU shared with a busy neighbour is slower. (Not a kernel that
spins on the clock, `torch.cuda._sleep`: it ends on time however the GPU is shared.)
Rank 0 appends every report it gets to <ckpt-dir>/reports.jsonl, and writes
<ckpt-dir>/FINISHED after --steps steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun.straggler import Detector

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100)
    # Cycle 0's steps, where they differ: a test that waits for cycle 0 to be cut short (an
    # exclusion) gives it more than a loaded host could finish before that.
    parser.add_argument("--first-cycle-steps", type=int, default=None)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--slow", default="", metavar="RANK:FACTOR")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpu-matmuls", type=int, default=4)
    args = parser.parse_args()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    factor = 1.0
    if args.slow and CYCLE == 0 and int(args.slow.split(":")[0]) == rank:
        factor = float(args.slow.split(":")[1])
    Detector.initialize(report_time_interval=1)
    matrix = torch.ones(4096, 4096, device=device) if device.type == "cuda" else None
    steps = args.steps if CYCLE or args.first_cycle_steps is None else args.first_cycle_steps
    for _ in range(steps):
        with Detector.detection_section("step"):
            if matrix is not None:
                for _ in range(round(args.gpu_matmuls * factor)):
                    torch.mm(matrix, matrix)
                torch.cuda.synchronize()
            else:
                time.sleep(args.step_time * factor)
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        report = Detector.generate_report_if_interval_elapsed()
        if report is not None:
            stragglers = report.identify_stragglers()["straggler_sections_relative"]
            line = {"cycle": CYCLE, "seq": report.seq, "ranks": sorted(report.rank_to_node),
                    "step": [s.rank for s in stragglers.get("step", ())]}  # fmt: skip
            with (args.ckpt_dir / "reports.jsonl").open("a") as out:
                out.write(json.dumps(line) + "\n")
    Detector.shutdown()
    dist.barrier()
    if rank == 0:
        (args.ckpt_dir / "FINISHED").touch()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
