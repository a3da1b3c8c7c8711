"""A plain training script with `ftrun.checkpointing.StepSnapshot`: a small MLP, AdamW, every
gradient all_reduced (gloo), a snapshot every step, heartbeats from the monitor client.

Each step's data comes from (step, rank), so a run is deterministic. The rank appends to
<ckpt-dir>/rank<R>.log: "resumed <cycle> <step> <digest>" after its restore (step 0: from scratch)
and "step <cycle> <step> <digest>" after every step, where <digest> is a SHA-256 of the model's
and the optimizer's tensors. <ckpt-dir>/FINISHED is written by rank 0 at the end.

--fault CYCLE:RANK:STEP:KIND[,...] hits that rank at the start of STEP in that cycle: `raise`
(an exception), `kill` (SIGKILL), `stop` (SIGSTOP: a hung rank).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun.checkpointing import StepSnapshot
from ftrun.client_lib import RankMonitorClient

CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for tensor in tensors:
        h.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", dest="out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--fault", default="", metavar="CYCLE:RANK:STEP:KIND")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snapshot = StepSnapshot()
    state = {"model": model, "optimizer": optimizer}
    start = snapshot.restore(state)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"rank{rank}.log").open("a")
    log.write(f"resumed {CYCLE} {start} {digest(model, optimizer)}\n")
    log.flush()
    faults = {
        tuple(map(int, f.split(":")[:3])): f.split(":")[3] for f in args.fault.split(",") if f
    }
    for step in range(start + 1, args.steps + 1):
        if (CYCLE, rank, step) in faults:
            hit(faults[CYCLE, rank, step])
        data = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32, generator=data)
        loss = (model(x) - x[:, :8]).pow(2).mean()
        loss.backward()
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        snapshot.save(state, step)
        log.write(f"step {CYCLE} {step} {digest(model, optimizer)}\n")
        log.flush()
        client.send_heartbeat(step)
        time.sleep(args.step_time)
    snapshot.close()
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()
    if rank == 0:
        (args.out / "FINISHED").touch()


def hit(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError("injected fault")
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


if __name__ == "__main__":
    main()
