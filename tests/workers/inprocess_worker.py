"""A plain gloo DDP loop wrapped by `ftrun.inprocess.Wrapper`, as a user writes one.

Each rank appends `pid iteration step time` to `<ckpt-dir>/steps-rank<R>.txt` after every step. A
fault is injected once (a marker file): `--fault raise` raises in `--fault-rank` at
`--fault-step`, `--fault raise-late` raises there 0.5 s late (the peers wait in the step's
collective meanwhile), `--fault kill` SIGKILLs that rank's own process there, `--fault hang`
sleeps (the monitor's or the wrapper's timeout must end it), `--fault abort-hangs` raises and
then the rank's abort never returns, `--fault finalize-fails` raises and then the rank's
`finalize` fails (a fault during the recovery). The time of the fault goes to
`<ckpt-dir>/fault.txt`. With `--snapshot`, the function resumes from a `StepSnapshot` of the
model taken after every step, created outside the wrapped function as NVRx's examples create
the model."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun import inprocess
from ftrun.checkpointing import StepSnapshot
from ftrun.client_lib import RankMonitorClient

# A test that times out asks for every thread's stack (tests/support.run_dumping_stacks).
faulthandler.register(signal.SIGUSR1, all_threads=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", dest="out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-time", type=float, default=0.02)
    faults = ["none", "raise", "raise-late", "kill", "hang", "abort-hangs", "finalize-fails"]
    parser.add_argument("--fault", default="none", choices=faults)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--soft-timeout", type=float, default=60.0)
    parser.add_argument("--heartbeats", action="store_true", help="send ft_launcher heartbeats")
    parser.add_argument("--snapshot", action="store_true",
                        help="resume from a StepSnapshot, not the step files")  # fmt: skip
    parser.add_argument(
        "--store-port",
        type=int,
        help="standalone: the wrapper's store (default MASTER_PORT + 1, as NVRx's examples); "
        "the function's store the next",
    )
    return parser.parse_args()


ARGS = parse()
STORE_PORT = ARGS.store_port or int(os.environ["MASTER_PORT"]) + 1


def fault_once(rank: int, step: int) -> None:
    marker = ARGS.out / "fault.txt"
    if ARGS.fault == "none" or rank != ARGS.fault_rank or step != ARGS.fault_step:
        return
    try:
        with open(marker, "x") as out:
            out.write(f"{time.time()}\n")
    except FileExistsError:
        return
    if ARGS.fault == "raise-late":
        time.sleep(0.5)
    if ARGS.fault in ("raise", "raise-late", "abort-hangs", "finalize-fails"):
        raise RuntimeError(f"injected fault at step {step} on rank {rank}")
    if ARGS.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


def resume_step(world: int) -> int:
    """The step every rank has made (a checkpoint's): after an in-job restart the ranks that
    went on without a lost one are ahead of it."""
    made = [ARGS.out / f"steps-rank{r}.txt" for r in range(world)]
    return min(len(p.read_text().splitlines()) if p.exists() else 0 for p in made)


class _FaultyAbort(inprocess.abort.Abort):
    """The fault rank's abort never returns (an NCCL abort that hangs), once."""

    def __call__(self, state: inprocess.FrozenState) -> inprocess.FrozenState:
        if ARGS.fault == "abort-hangs" and state.rank == ARGS.fault_rank:
            marker = ARGS.out / "abort-hung"
            if not marker.exists():
                marker.touch()
                time.sleep(3600)
        return state


class _FaultyFinalize(inprocess.finalize.Finalize):
    def __call__(self, state: inprocess.FrozenState) -> inprocess.FrozenState:
        if ARGS.fault == "finalize-fails" and state.rank == ARGS.fault_rank:
            marker = ARGS.out / "finalize-failed"
            if not marker.exists():
                marker.touch()
                raise RuntimeError("finalize failed")
        return state


@inprocess.Wrapper(
    store_kwargs={"port": STORE_PORT},
    abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), _FaultyAbort()),
    finalize=_FaultyFinalize(),
    soft_timeout=datetime.timedelta(seconds=ARGS.soft_timeout),
    hard_timeout=datetime.timedelta(seconds=ARGS.soft_timeout + 30),
    barrier_timeout=datetime.timedelta(seconds=ARGS.soft_timeout + 60),
)
def train(model: torch.nn.Module, call_wrapper: inprocess.CallWrapper | None = None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], STORE_PORT + 1,
                          world, rank == 0, multi_tenant=True)  # fmt: skip
    prefix = dist.PrefixStore(f"it{call_wrapper.iteration}", store)
    dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    monitor = RankMonitorClient() if ARGS.heartbeats else None
    if monitor is not None:  # a registration per iteration: a hang verdict ends the last one
        monitor.init_workload_monitoring()
    done = ARGS.out / f"steps-rank{rank}.txt"
    state = {"model": model}
    start = SNAPSHOT.restore(state) if SNAPSHOT is not None else resume_step(world)
    with done.open("a") as out:
        for step in range(start, ARGS.steps):
            fault_once(rank, step)
            ddp(torch.ones(4, 8)).sum().backward()
            call_wrapper.ping()
            if monitor is not None:
                monitor.send_heartbeat()
            out.write(f"{os.getpid()} {call_wrapper.iteration} {step} {time.time()}\n")
            out.flush()
            if SNAPSHOT is not None:
                SNAPSHOT.save(state, step + 1)
            time.sleep(ARGS.step_time)
    dist.barrier()
    dist.destroy_process_group()
    if monitor is not None:
        monitor.shutdown_workload_monitoring()


SNAPSHOT = StepSnapshot() if ARGS.snapshot else None  # outside the function: across iterations

if __name__ == "__main__":
    ARGS.out.mkdir(parents=True, exist_ok=True)
    train(torch.nn.Linear(8, 8))
