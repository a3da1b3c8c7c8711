"""Two mistakes a new user of `ftrun.inprocess` makes, as they write them (gloo, 2 ranks).

`--mistake unannotated`: the function's `call_wrapper` parameter lacks its `CallWrapper`
annotation (NVRx passes such a parameter nothing: every entry fails on `call_wrapper.iteration`).
`--mistake raise-always`: the function raises the same error at every entry.
Either way, rank 0 writes `<ckpt-dir>/done` if the function returns."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun import inprocess

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", dest="out", type=Path, required=True)
parser.add_argument("--mistake", choices=["unannotated", "raise-always", "plain-init-raises"],
                    required=True)  # fmt: skip
ARGS = parser.parse_args()


@inprocess.Wrapper()
def train(call_wrapper=None):  # the mistake: no `CallWrapper` annotation
    if ARGS.mistake == "raise-always":  # on entry, before any process group
        raise ValueError("the data path is wrong")
    if ARGS.mistake == "plain-init-raises":  # env://, no store prefix: not a mistake any more
        dist.init_process_group("gloo")
        if call_wrapper.iteration < 3:
            raise ValueError(f"iteration {call_wrapper.iteration} fails")
        dist.barrier()
        if dist.get_rank() == 0:
            (ARGS.out / "done").write_text("3\n")
        dist.destroy_process_group()
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    iteration = call_wrapper.iteration if call_wrapper is not None else "none"
    # A store prefix per restart iteration, as docs/inprocess.md's snippet has it (the store
    # the launcher serves keeps the keys of every iteration's group).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False)  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore(f"it{iteration}", store),
                            rank=rank, world_size=world)  # fmt: skip
    total = torch.ones(1) * call_wrapper.iteration
    dist.all_reduce(total)
    if rank == 0:
        (ARGS.out / "done").write_text(f"{total.item()}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    ARGS.out.mkdir(parents=True, exist_ok=True)
    train()
