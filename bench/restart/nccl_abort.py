"""The floor of an in-process restart's abort: `ProcessGroupNCCL.abort()` with and without the
wake-ups to NCCL's proxy threads (`ftrun.inprocess.nccl_wake`), alternating in one job.

On the device, from the repository root (it starts itself under torchrun, a process a GPU):

    python3 -m bench.restart.nccl_abort --rounds 8

Each round makes a fresh NCCL group (its own store prefix), runs one all_reduce, lines the ranks
up on the store, aborts the group's backend (timed on each rank) and destroys the group. Rank 0
prints each round's slowest rank, then the medians with and without the wake-ups.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from bench.common import smoke
from ftrun.inprocess.nccl_wake import (
    ProxyWaker,
    own_tcp_listeners,
    own_uds_addresses,
)


def one_round(number: int, wake: bool, base: dist.Store) -> float:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(f"round{number}", base)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    value = torch.ones(1, device=device)
    dist.all_reduce(value)
    torch.cuda.synchronize()
    if number == 0 and rank == 0:
        print(f"rank 0 before its first abort: {len(own_uds_addresses())} NCCL UDS socket(s), "
              f"{len(own_tcp_listeners())} TCP listener(s)", flush=True)  # fmt: skip
    store.add("lined-up", 1)
    if rank:
        store.wait(["go"])
    else:
        _release(store, world)
    backend = dist.group.WORLD._get_backend(device)
    started = time.monotonic()
    waker = ProxyWaker(enabled=wake)
    with waker:
        backend.abort()
    took = time.monotonic() - started
    if wake and rank == 0:
        print(f"round {number}: rank 0 sent {waker.pokes} wake-up(s)", flush=True)
    dist.destroy_process_group()
    return took


def _release(store: dist.Store, world: int) -> None:
    while store.add("lined-up", 0) < world:
        time.sleep(0.001)
    store.set("go", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds, alternating (even)")
    args = smoke.parse_args(parser, {"rounds": 2})
    if not torch.cuda.is_available():
        smoke.skip_gpu("nccl_abort", "the NCCL aborts")
        return
    if "RANK" not in os.environ:  # the user's command: the ranks, one a GPU, under torchrun
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={torch.cuda.device_count()}", "-m", "bench.restart.nccl_abort",
               f"--rounds={args.rounds}"]  # fmt: skip
        sys.exit(subprocess.run(run, check=False).returncode)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # torchrun's agent serves the store at MASTER_PORT; the workers are its clients.
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=60)
    agent_store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    base = dist.PrefixStore(f"nccl-abort-{os.environ.get('TORCHELASTIC_RUN_ID', '')}", agent_store)
    times: dict[bool, list[float]] = {False: [], True: []}
    for number in range(args.rounds):
        wake = number % 2 == 1
        took = one_round(number, wake, base)
        base.set(f"took/{number}/{rank}", f"{took:.4f}")
        if rank == 0:
            slowest = max(float(base.get(f"took/{number}/{r}")) for r in range(world))
            times[wake].append(slowest)
            print(f"round {number} ({'woken' if wake else 'plain'}): slowest rank's abort "
                  f"{slowest:.3f} s", flush=True)  # fmt: skip
    if rank == 0:
        for wake, label in ((False, "plain"), (True, "woken")):
            print(f"{label}: median {statistics.median(times[wake]):.3f} s "
                  f"({', '.join(f'{t:.3f}' for t in times[wake])})")  # fmt: skip


if __name__ == "__main__":
    main()
