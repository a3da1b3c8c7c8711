"""A rank that logs its own step times, to check `ftrun report` against: no torch, no network.

Every cycle it first "starts up" for --startup seconds (imports, data loading, compilation: no
progress yet), waits until every rank of the cycle is ready (files in <ckpt-dir>, as a first
collective would: ranks then step together), resumes after its own checkpoint, then steps:
start_section("step"), sleep --step-time, end_section("step", iteration=step),
send_heartbeat(iteration=step), append "<cycle> <step> <wall time>" to
<ckpt-dir>/steps-rank<R>.txt. Every --save-every steps it checkpoints (<ckpt-dir>/
checkpoint-rank<R> holds the step). After --steps it exits 0.

--crash CYCLE:RANK:STEP: that rank appends "<cycle> crash <wall time>" to its steps file and
exits 1 at the start of STEP, and the other ranks stop at the start of STEP of that cycle as
if blocked in a collective with the dead rank (until the launcher stops them): so every rank's
last step before the fault is STEP - 1, as in synchronous training.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ftrun.client_lib import RankMonitorClient

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))
RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--startup", type=float, default=0.0)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--crash", default="", metavar="CYCLE:RANK:STEP")
    return parser.parse_args()


def blocked_in_collective() -> None:
    time.sleep(600)


def barrier(out: Path) -> None:
    """Every rank of this cycle is ready: the ranks start stepping together."""
    (out / f"ready-{CYCLE}-{RANK}").touch()
    deadline = time.monotonic() + 60
    while len(list(out.glob(f"ready-{CYCLE}-*"))) < WORLD_SIZE:
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.002)


def main() -> int:
    args = parse_args()
    out = args.ckpt_dir
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / f"checkpoint-rank{RANK}"
    crash = [int(x) for x in args.crash.split(":")] if args.crash else None
    client = RankMonitorClient()
    client.init_workload_monitoring()
    time.sleep(args.startup)
    barrier(out)
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    log = (out / f"steps-rank{RANK}.txt").open("a")
    for step in range(start + 1, args.steps + 1):
        if crash is not None and (crash[0], crash[2]) == (CYCLE, step):
            if crash[1] == RANK:
                log.write(f"{CYCLE} crash {time.time():.6f}\n")
                log.flush()
                os._exit(1)
            blocked_in_collective()
        client.start_section("step")
        time.sleep(args.step_time)
        client.end_section("step", iteration=step)
        client.send_heartbeat(iteration=step)
        log.write(f"{CYCLE} {step} {time.time():.6f}\n")
        log.flush()
        if step % args.save_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(f"{step}\n")
            os.replace(tmp, ckpt)
    client.shutdown_workload_monitoring()
    return 0


if __name__ == "__main__":
    sys.exit(main())
