"""A wrapped function that fails `--faults` times in a row, for what a restart leaves behind.

Each iteration, rank `iteration % world` raises once every rank has entered it (no process
group: gloo's aborted groups are pinned for good, see `ftrun.inprocess.abort.pin_gloo_groups`,
and would be counted too); the iteration after the last fault returns. On entering each
iteration every rank appends `iteration threads fds keys tasks gpu_mb` to
`<out>/resources-rank<R>.txt`: this process's Python threads, open descriptors, the keys of the
wrapper's coordination store (served by rank 0 at `--store-port`, by default `MASTER_PORT + 1`
as in NVRx's examples), its OS threads (NCCL's included) and the memory in use on its GPU.

`--device cuda`: each iteration also makes an NCCL group (on a prefix of its own, as NVRx's
examples do) and its communicator (one all_reduce) before counting, and the ranks that do not
fail wait in an all_reduce that the failing rank never joins, as peers of a real fault do."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun import inprocess

# A test that times out asks for every thread's stack (tests/support.run_dumping_stacks).
faulthandler.register(signal.SIGUSR1, all_threads=True)
parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--faults", type=int, default=20)
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--store-port", type=int, help="the wrapper's store (default MASTER_PORT + 1)")
ARGS = parser.parse_args()
PORT = ARGS.store_port or int(os.environ["MASTER_PORT"]) + 1


STORE: list[dist.Store] = []
"""A client of the wrapper's store, made at the first call (rank 0 serves it from then on) and
kept: its descriptor is there from iteration 0 on."""


@inprocess.Wrapper(store_kwargs={"port": PORT})
def train(base: dist.Store | None, call_wrapper: inprocess.CallWrapper | None = None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    iteration = call_wrapper.iteration
    if not STORE:
        STORE.append(dist.TCPStore(os.environ["MASTER_ADDR"], PORT, is_master=False))
    gpu_mb, ones = 0, None
    if base is not None:
        dist.init_process_group("nccl", store=dist.PrefixStore(str(iteration), base),
                                rank=rank, world_size=world)  # fmt: skip
        ones = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(ones)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        gpu_mb = (total - free) >> 20
    counts = [threading.active_count(), len(os.listdir("/proc/self/fd")), STORE[0].num_keys(),
              len(os.listdir("/proc/self/task")), gpu_mb]  # fmt: skip
    with (ARGS.out / f"resources-rank{rank}.txt").open("a") as out:
        out.write(" ".join(map(str, [iteration, *counts])) + "\n")
    failing = iteration < ARGS.faults and rank == iteration % world
    if failing:
        await_peers(iteration, world)
        raise RuntimeError(f"fault {iteration + 1} of {ARGS.faults}")
    if ones is not None:
        dist.all_reduce(ones)  # the peers of a fault wait here until the wrapper aborts NCCL
        torch.cuda.synchronize()
        dist.destroy_process_group()


def await_peers(iteration: int, world: int, deadline_s: float = 30.0) -> None:
    """Until every rank has counted this iteration's resources (a fault before that would
    catch a peer's abort of this iteration in its count)."""
    deadline = time.monotonic() + deadline_s
    files = [ARGS.out / f"resources-rank{r}.txt" for r in range(world)]
    while not all(f.exists() and f"\n{iteration} " in f"\n{f.read_text()}" for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not all enter iteration {iteration}")
        time.sleep(0.005)


def main() -> None:
    ARGS.out.mkdir(parents=True, exist_ok=True)
    base = None
    if ARGS.device == "cuda":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        base = dist.TCPStore(os.environ["MASTER_ADDR"], PORT + 1, world, rank == 0,
                             multi_tenant=True)  # fmt: skip
    train(base)


if __name__ == "__main__":
    main()
