"""A plain data-parallel training script, written the way a new user writes one.

Nothing in it is tuned for a launcher: `init_process_group("gloo")`, a tiny DDP model (or, with
`--model allreduce`, an all_reduce of a small tensor), a short sleep per step standing for the
rest of the step, a checkpoint every `--ckpt-every` steps that the next run resumes from, and a
`RankMonitorClient` with NVRx's method names (ftrun's or NVRx's, by `--client`). Errors
propagate: no signal handlers, no `os._exit`, the interpreter's normal teardown. Run it under
any launcher:

    ft_launcher --nproc-per-node=2 bench/workers/user_worker.py --client ftrun --out /tmp/run
    torchrun --nproc-per-node=2 bench/workers/user_worker.py --client none --out /tmp/run

One line per step goes to `<out>/rank<RANK>.log` (the only habit the benchmark needs):

    <wall-clock s> rank=<r> pid=<pid> step=<n> loss=<x>
    <wall-clock s> rank=<r> pid=<pid> step=<n> fault=<crash|hang>     (before the fault)

Fault injection, for trying a launcher: rank `--fault-rank` at step `--fault-step` (or after
`--fault-after` seconds of training) raises (`crash`) or sleeps inside its step section
(`hang`). The fault fires once per run: the rank that fires it leaves `<out>/fault.done`
behind, so the restarted job trains on.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="train this many steps in all")
    parser.add_argument(
        "--model",
        choices=["ddp", "allreduce"],
        default="ddp",
        help="ddp: a tiny DistributedDataParallel model; allreduce: all_reduce of a small tensor",
    )
    parser.add_argument("--step-sleep", type=float, default=0.05, help="s of 'work' per step")
    parser.add_argument("--out", type=Path, default=Path("train-out"), help="step logs go here")
    parser.add_argument("--ckpt", type=Path, help="checkpoint file (default: <out>/ckpt.pt)")
    parser.add_argument("--ckpt-every", type=int, default=100, help="0: no checkpoints")
    parser.add_argument(
        "--client",
        choices=["auto", "ftrun", "nvrx", "none"],
        default="auto",
        help="RankMonitorClient to use; auto: the one whose launcher is running us",
    )
    parser.add_argument("--fault", choices=["none", "crash", "hang"], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=0, help="fault at this step (0: off)")
    parser.add_argument(
        "--fault-after", type=float, default=0.0, help="or after this many s of training"
    )
    return parser.parse_args()


def monitor_client(choice: str):
    """The launcher's RankMonitorClient, or None under a launcher without one (torchrun)."""
    if choice == "auto":
        if os.environ.get("FTRUN_MONITOR_ADDR"):
            choice = "ftrun"
        elif os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
            choice = "nvrx"
        else:
            return None
    if choice == "ftrun":
        from ftrun.client_lib import RankMonitorClient
    elif choice == "nvrx":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    else:
        return None
    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client


def make_model(kind: str) -> tuple[DDP | None, torch.optim.Optimizer | None]:
    if kind == "allreduce":
        return None, None
    model = DDP(nn.Linear(32, 32))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model, optimizer, data: torch.Tensor, target: torch.Tensor) -> float:
    if model is None:  # no model: all-reduce a small tensor, as a gradient would be
        grad = data.mean(0)
        dist.all_reduce(grad)
        return float(grad.norm())
    loss = nn.functional.mse_loss(model(data), target)
    optimizer.zero_grad()
    loss.backward()  # DDP all-reduces the gradients here
    optimizer.step()
    return loss.item()


def fault_due(args: argparse.Namespace, rank: int, step: int, trained_s: float) -> bool:
    """Whether this rank injects its fault now (once per run: `<out>/fault.done` remembers)."""
    if args.fault == "none" or rank != args.fault_rank or (args.out / "fault.done").exists():
        return False
    return step == args.fault_step or (args.fault_after > 0 and trained_s >= args.fault_after)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.ckpt or args.out / "ckpt.pt"
    log = open(args.out / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 (whole run)

    torch.manual_seed(0)
    model, optimizer = make_model(args.model)
    start_step = 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path)
        if model is not None:
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]

    client = monitor_client(args.client)
    data, target = torch.randn(64, 32), torch.randn(64, 32)
    who = f"rank={rank} pid={os.getpid()}"
    began = time.monotonic()
    for step in range(start_step + 1, args.steps + 1):
        if client:
            client.start_section("step")
        if fault_due(args, rank, step, time.monotonic() - began):
            (args.out / "fault.done").touch()
            print(f"{time.time():.6f} {who} step={step} fault={args.fault}", file=log)
            if args.fault == "crash":
                raise RuntimeError(f"injected crash at step {step}")
            while True:  # hang: stuck inside the step, no more heartbeats
                time.sleep(60)

        loss = train_step(model, optimizer, data, target)
        time.sleep(args.step_sleep)

        if client:
            client.end_section("step")
            client.send_heartbeat()
        print(f"{time.time():.6f} {who} step={step} loss={loss:.4f}", file=log)
        if rank == 0 and args.ckpt_every and step % args.ckpt_every == 0:
            state = {"step": step}
            if model is not None:
                state["model"] = model.module.state_dict()
                state["optimizer"] = optimizer.state_dict()
            torch.save(state, f"{ckpt_path}.tmp")
            os.replace(f"{ckpt_path}.tmp", ckpt_path)

    if client:
        client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
