"""Where a snapshot's stall comes from on a GPU host (issue 53's diagnosis, one process):

1. the device-to-host copy's bandwidth for the state's size into memory page-locked three ways
   (cudaHostAlloc, a /dev/shm mapping registered with cudaHostRegister as StepSnapshot's parts
   are, and pageable memory);
2. what registering that mapping costs, and whether the caller's kernel launches wait for it
   meanwhile (the longest gap between 2,000 small launches while another thread registers);
3. each step's time in the first steps of two lives of the 151M DDP script with a snapshot
   every step: a fresh start, then a restart that restores (what a heartbeat timeout computed
   after 20 steps sees).

    python -m bench.goodput.copy_probe [--steps 25] [--smoke]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.common import smoke
from bench.goodput.stall import build
from ftrun.checkpointing import StepSnapshot, pinning
from ftrun.identity import free_port


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return src.numel() / best / 1e9


def bandwidth(nbytes: int) -> None:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    path = Path(tempfile.mkdtemp(dir="/dev/shm")) / "part"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    mapping = pinning.Mapping(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    os.close(fd)
    gaps: list[float] = []
    done = threading.Event()
    registered: list[float] = []

    def register() -> None:
        started = time.perf_counter()
        pinning.pin(mapping, torch.device("cuda", 0))
        registered.append(time.perf_counter() - started)
        done.set()

    tiny = torch.zeros(1, device="cuda")
    thread = threading.Thread(target=register)
    last = time.perf_counter()
    thread.start()
    while not done.is_set():
        tiny.add_(1)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    shm = torch.frombuffer(mapping, dtype=torch.uint8)
    print(
        f"state {nbytes / 2**30:.2f} GiB: cudaHostRegister {registered[0] * 1e3:.0f} ms; the "
        f"caller's longest launch gap meanwhile {max(gaps) * 1e3:.1f} ms ({len(gaps)} launches)"
    )
    print(f"device-to-host GB/s: cudaHostAlloc {copy_gbps(src, pinned):.1f}, registered /dev/shm "
          f"{copy_gbps(src, shm):.1f}, pageable {copy_gbps(src, pageable):.1f}")  # fmt: skip
    del shm
    mapping.close()
    shutil.rmtree(path.parent)


def lives(args: argparse.Namespace) -> None:
    device = torch.device("cuda", 0)
    model, net = build(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(args.batch, args.seq, args.d_model, device=device)
    state = {"model": model, "optimizer": optimizer}
    directory = Path(tempfile.mkdtemp(prefix="ftrun-probe-", dir="/dev/shm"))
    start = 0
    for life in ("fresh start", "restart"):
        snapshot = StepSnapshot(directory)
        start = snapshot.restore(state) if start else 0
        times = []
        for step in range(start + 1, start + 1 + args.steps):
            began = time.perf_counter()
            nn.functional.mse_loss(net(data), data).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            snapshot.save(state, step)
            times.append((time.perf_counter() - began) * 1e3)
        snapshot.close()
        start = step
        print(f"{life}: step ms " + " ".join(f"{t:.0f}" for t in times)
              + f"; taken {snapshot.taken}, skipped {snapshot.skipped}")  # fmt: skip
    shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    args = smoke.parse_args(parser, {"steps": 3})
    if not torch.cuda.is_available():
        smoke.skip_gpu("copy_probe", "every measurement (the state is on a GPU)")
        return
    args.d_model, args.layers, args.batch, args.seq, args.fsdp2 = 1024, 12, 8, 512, False
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        bandwidth(int(1.69 * 2**30))
        lives(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
