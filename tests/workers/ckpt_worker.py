"""A gloo training loop that checkpoints with `ftrun.checkpointing.LocalCheckpointManager`.

Each step is one all_reduce. Every --save-every steps each rank saves its part (async) with a
clique replication strategy (jump = ranks per node, factor 2: copies on the next node). At
start it loads the newest checkpoint the launcher's agents agreed on (or torchrun's
collective), and appends "<cycle> <step> <loaded>" to <ckpt-dir>/rank<R>.log after every step
(loaded: the iteration it resumed from, -1: none).
Writes <ckpt-dir>/FINISHED after --steps. `--device cuda`: NCCL, the state on the rank's GPU
(`cuda:LOCAL_RANK`).

Faults (each in one cycle): --crash CYCLE:RANK:STEP exits 1 at STEP; --die-in-save
CYCLE:RANK:STEP SIGKILLs itself in the middle of the save of STEP: its bytes are written, the
rename that makes the part visible never happens.

With --global-every N, every Nth save is also an async global save (`GlobalCheckpointManager`,
DCP) to <ckpt-dir>/global, and a restart restores with `restore` across both tiers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftrun.checkpointing import CliqueReplicationStrategy, LocalCheckpointManager

CYCLE = int(os.environ.get("FTRUN_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
RANK = int(os.environ.get("RANK", "0"))


def fires(spec: str, step: int) -> bool:
    return bool(spec) and [int(x) for x in spec.split(":")] == [CYCLE, RANK, step]


def die(*_args: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", dest="out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--mb", type=float, default=1.0, help="state size per rank")
    parser.add_argument("--crash", default="")
    parser.add_argument("--die-in-save", default="")
    parser.add_argument("--global-every", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # copies go to the next node
    strategy = CliqueReplicationStrategy.from_replication_params(per_node, 2)
    manager = LocalCheckpointManager(args.out / "local", repl_strategy=strategy)
    weights = torch.zeros(int(args.mb * 2**20) // 4, device=device)
    if args.global_every:
        with_global_tier(args, manager, weights)
    else:
        local_only(args, manager, weights)
    manager.wait()
    if RANK == 0:
        (args.out / "FINISHED").touch()
    dist.destroy_process_group()
    return 0


def local_only(
    args: argparse.Namespace, manager: LocalCheckpointManager, weights: torch.Tensor
) -> None:
    """Logs "<cycle> <step> <loaded>"."""
    start, loaded = 0, manager.find_latest()
    if loaded >= 0:
        state, _ = manager.load()
        weights.copy_(state["weights"])
        start = state["step"]
        assert state["rank"] == RANK and float(weights[0]) == start, (state["rank"], start)
        del state
    log = (args.out / f"rank{RANK}.log").open("a")
    for step in range(start + 1, args.steps + 1):
        train_step(args, weights, step)
        if step % args.save_every == 0:
            if fires(args.die_in_save, step):
                os.replace = die  # the save's last act before its part is visible
            manager.save({"weights": weights, "step": step, "rank": RANK}, step, is_async=True)
        log.write(f"{CYCLE} {step} {loaded}\n")
        log.flush()


def with_global_tier(
    args: argparse.Namespace, local: LocalCheckpointManager, weights: torch.Tensor
) -> None:
    """Both tiers, restored with `restore`; logs "<cycle> <step> <loaded> <tier>"."""
    from ftrun.checkpointing import CheckpointNotFoundError, GlobalCheckpointManager, restore

    glob = GlobalCheckpointManager(args.out / "global", keep_last=2, timeout_s=60)
    state = {f"weights.r{RANK}": weights, "step": 0}
    try:
        restored = restore([local, glob], state)
        loaded, tier, start = restored.iteration, restored.tier, restored.state["step"]
        assert float(weights[0]) == start == loaded, (float(weights[0]), start, loaded)
    except CheckpointNotFoundError:
        loaded, tier, start = -1, "none", 0
    log = (args.out / f"rank{RANK}.log").open("a")
    for step in range(start + 1, args.steps + 1):
        train_step(args, weights, step)
        glob.maybe_finalize()
        if step % args.save_every == 0:
            state["step"] = step
            local.save(state, step, is_async=True)
            if step % (args.save_every * args.global_every) == 0:
                glob.save(state, step)
        log.write(f"{CYCLE} {step} {loaded} {tier}\n")
        log.flush()
    glob.maybe_finalize(blocking=True)
    glob.close()


def train_step(args: argparse.Namespace, weights: torch.Tensor, step: int) -> None:
    """One step: the injected crash, one all_reduce, the state changed, the step's time."""
    if fires(args.crash, step):
        sys.exit(1)
    value = torch.ones(1, device=weights.device)
    dist.all_reduce(value)
    weights.fill_(step)
    time.sleep(args.step_time)


if __name__ == "__main__":
    sys.exit(main())
