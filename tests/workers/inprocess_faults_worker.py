"""A wrapped function that fails `--faults` times in a row, for what a restart leaves behind.

Each iteration, rank `iteration % world` raises once every rank has entered it (no process
group: gloo's aborted groups are pinned for good, see `ftrun.inprocess.abort.pin_gloo_groups`,
and would be counted too); the iteration after the last fault returns. On entering each
iteration every rank appends `iteration threads fds keys` to `<out>/resources-rank<R>.txt`: this
process's threads and open descriptors, and the keys of the wrapper's coordination store
(served by rank 0 at `MASTER_PORT + 1`, as under torchrun)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ftrun import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--faults", type=int, default=20)
ARGS = parser.parse_args()
PORT = int(os.environ["MASTER_PORT"]) + 1


STORE: list[dist.Store] = []
"""A client of the wrapper's store, made at the first call (rank 0 serves it from then on) and
kept: its descriptor is there from iteration 0 on."""


@inprocess.Wrapper(store_kwargs={"port": PORT})
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    iteration = call_wrapper.iteration
    if not STORE:
        STORE.append(dist.TCPStore(os.environ["MASTER_ADDR"], PORT, is_master=False))
    keys = STORE[0]
    fds = len(os.listdir("/proc/self/fd"))
    with (ARGS.out / f"resources-rank{rank}.txt").open("a") as out:
        out.write(f"{iteration} {threading.active_count()} {fds} {keys.num_keys()}\n")
    if iteration < ARGS.faults and rank == iteration % world:
        await_peers(iteration, world)
        raise RuntimeError(f"fault {iteration + 1} of {ARGS.faults}")


def await_peers(iteration: int, world: int, deadline_s: float = 30.0) -> None:
    """Until every rank has counted this iteration's resources (a fault before that would
    catch a peer's abort of this iteration in its count)."""
    deadline = time.monotonic() + deadline_s
    files = [ARGS.out / f"resources-rank{r}.txt" for r in range(world)]
    while not all(f.exists() and f"\n{iteration} " in f"\n{f.read_text()}" for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not all enter iteration {iteration}")
        time.sleep(0.005)


if __name__ == "__main__":
    ARGS.out.mkdir(parents=True, exist_ok=True)
    train()
