"""A lean gloo worker for the launcher benchmarks; it runs under ft_launcher, torchrun or NVRx.

Appends one line per event to `<out>/rank<RANK>.log` (wall-clock seconds, one `os.write` each on
an O_APPEND file, so lines never interleave):

    start <ts> <pid> <cycle>    first thing the script does, before importing torch
    step <cycle> <n> <ts>       after each all_reduce + 0.05 s sleep
    fault <kind> <ts>           right before the injected fault

The output directory comes from `--out` or `BENCH_OUT`. A fault (`--fault crash|hang`) fires once
per job: rank `--fault-rank` at step `--fault-step` (or, with `--fault-on-trigger`, at the first
step that finds `<out>/fault.trigger`, which the bench creates when it is ready) creates
`<out>/fault.marker` with O_CREAT|O_EXCL, and only the process that created it faults.
(torchelastic counts restarts per agent, so the restart count cannot say "first cycle of the
job".) crash: `os._exit(1)`; hang: sleep forever without heartbeats.

Heartbeats: ftrun's RankMonitorClient when `FTRUN_MONITOR_ADDR` is set, NVRx's when
`FT_RANK_MONITOR_IPC_SOCKET` is set, none otherwise (plain torchrun).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

FTRUN_ENV = "FTRUN_MONITOR_ADDR"
NVRX_ENV = "FT_RANK_MONITOR_IPC_SOCKET"
STEP_SLEEP_S = 0.05
TRIGGER = "fault.trigger"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=os.environ.get("BENCH_OUT"))
    parser.add_argument("--fault", choices=["none", "crash", "hang"], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=100, help="0: only the trigger")
    parser.add_argument(
        "--fault-on-trigger", action="store_true", help="fault once <out>/fault.trigger exists"
    )
    parser.add_argument("--max-seconds", type=float, default=300.0, help="then exit 0")
    args = parser.parse_args()
    if args.out is None:
        parser.error("give --out or set BENCH_OUT")
    return args


class RankLog:
    """The per-rank event file; every record is one atomic append."""

    def __init__(self, out: Path, rank: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, *fields: object) -> None:
        os.write(self._fd, (" ".join(str(f) for f in fields) + "\n").encode())


def fault_due(args: argparse.Namespace, rank: int, step: int) -> bool:
    if args.fault == "none" or rank != args.fault_rank:
        return False
    if step == args.fault_step:
        return True
    return args.fault_on_trigger and (args.out / TRIGGER).exists()


def claim_fault(out: Path) -> bool:
    """True for exactly one process per job: the one that creates the marker file."""
    try:
        fd = os.open(out / "fault.marker", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    return True


def heartbeat_fn() -> Callable[[], None]:
    """The launcher's heartbeat call, or a no-op when no monitor is present."""
    if os.environ.get(FTRUN_ENV):
        from ftrun.client_lib import RankMonitorClient

        client = RankMonitorClient()
    elif os.environ.get(NVRX_ENV):
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
    else:
        return lambda: None
    client.init_workload_monitoring()
    return client.send_heartbeat


def cycle() -> str:
    """ftrun's job-wide cycle, else torchelastic's per-agent restart count."""
    return os.environ.get("FTRUN_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def inject(kind: str, log: RankLog) -> None:
    log.write("fault", kind, f"{time.time():.6f}")
    if kind == "crash":
        os._exit(1)
    while True:  # hang: no heartbeat, no collective, until the launcher kills us
        time.sleep(3600)


def run(args: argparse.Namespace, rank: int, log: RankLog) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    heartbeat = heartbeat_fn()
    tensor = torch.ones(4)
    deadline = time.monotonic() + args.max_seconds
    this_cycle = cycle()
    step = 0
    while time.monotonic() < deadline:
        step += 1
        if fault_due(args, rank, step) and claim_fault(args.out):
            inject(args.fault, log)
        dist.all_reduce(tensor)
        time.sleep(STEP_SLEEP_S)
        log.write("step", this_cycle, step, f"{time.time():.6f}")
        heartbeat()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    log = RankLog(args.out, rank)
    log.write("start", f"{time.time():.6f}", os.getpid(), cycle())
    run(args, rank, log)


if __name__ == "__main__":
    main()
