"""What `StepSnapshot` costs a training step: the 151M transformer of the GPU benches (DDP, or
FSDP2 with `--fsdp2`), AdamW, one process, blocks of steps without and with a snapshot every
step, interleaved; medians of each block's steps, and the ratio pair by pair.

Reported: the step time without and with snapshots, the overhead (with / without - 1), the
time `save()` holds the caller, how many snapshots were taken (a save that finds the previous
one still in the background is skipped); the state's size, the node memory a snapshot holds
(/dev/shm) and what the state's own `state_dict()` calls cost.

    python -m bench.goodput.stall [--device cuda|cpu] [--fsdp2] [--blocks 3] [--steps 20]
        [--d-model 1024 --layers 12] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.common import smoke
from ftrun.checkpointing import StepSnapshot
from ftrun.identity import free_port


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """(the model whose state is saved, the module the step runs)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        args.d_model, max(1, args.d_model // 64), 4 * args.d_model, dropout=0.0, batch_first=True
    )
    model = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False).to(device)
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        return fully_shard(model), model
    ids = [device.index] if device.type == "cuda" else None
    return model, nn.parallel.DistributedDataParallel(model, device_ids=ids)


def run_block(step, snapshot: StepSnapshot | None, state: dict, first: int, n: int) -> list[float]:
    times = []
    for i in range(first, first + n):
        started = time.perf_counter()
        step()
        if snapshot is not None:
            snapshot.save(state, i)
        times.append(time.perf_counter() - started)
    if snapshot is not None:
        snapshot.wait()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    sizes = {"device": "cpu", "d_model": 32, "layers": 1, "batch": 2, "seq": 8, "steps": 4,
             "blocks": 1}  # fmt: skip
    args = smoke.parse_args(parser, sizes)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    model, net = build(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234)
    data = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(device)
    target = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(device)

    def step() -> None:
        loss = nn.functional.mse_loss(net(data), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()  # the step ends on the device

    directory = Path(tempfile.mkdtemp(prefix="ftrun-stall-", dir="/dev/shm"))
    try:
        measure(args, device, model, optimizer, step, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        dist.destroy_process_group()


def measure(args, device, model, optimizer, step, directory: Path) -> None:
    state = {"model": model, "optimizer": optimizer}
    run_block(step, None, state, 1, 3)  # warm-up: kernels, the optimizer's state
    snapshot = StepSnapshot(directory)
    run_block(step, snapshot, state, 1, 2)  # the first save maps and page-locks node memory
    without: list[float] = []
    with_: list[float] = []
    taken, stalls_from = 0, len(snapshot.stalls)
    for block in range(args.blocks):  # interleaved: without, then with
        without.append(statistics.median(run_block(step, None, state, 1, args.steps)))
        before = snapshot.taken
        first = 100 + block * args.steps  # steps not saved before: new parts, as in training
        with_.append(statistics.median(run_block(step, snapshot, state, first, args.steps)))
        taken += snapshot.taken - before
    snapshot.close()
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(
        f"machine: {name}, torch {torch.__version__}; {'FSDP2' if args.fsdp2 else 'DDP'}, "
        f"d_model {args.d_model} x {args.layers} layers, batch {args.batch} x {args.seq}"
    )
    held = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    print(
        f"state: {state_bytes(model, optimizer) / 2**30:.2f} GiB; node memory held (2 steps "
        f"kept): {held / 2**30:.2f} GiB; state_dict() calls: {state_dict_ms(state)}"
    )
    ratios = [w / b for w, b in zip(with_, without, strict=True)]
    stalls = sorted(snapshot.stalls[stalls_from:])
    print(
        f"step without: {statistics.median(without) * 1e3:.1f} ms, with a snapshot each step: "
        f"{statistics.median(with_) * 1e3:.1f} ms, overhead (median of {args.blocks} pairs) "
        f"{(statistics.median(ratios) - 1) * 100:+.1f} %; save() median "
        f"{stalls[len(stalls) // 2] * 1e3:.2f} ms, max {stalls[-1] * 1e3:.2f} ms; taken "
        f"{taken} of {args.blocks * args.steps}"
    )


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    found = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return found + sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def state_dict_ms(state: dict) -> str:
    """What `save()` spends in the state's own `state_dict()` calls (median of 5 each)."""
    found = []
    for key, value in state.items():
        times = []
        for _ in range(5):
            started = time.perf_counter()
            value.state_dict()
            times.append(time.perf_counter() - started)
        found.append(f"{key} {statistics.median(times) * 1e3:.2f} ms")
    return ", ".join(found)


if __name__ == "__main__":
    main()
