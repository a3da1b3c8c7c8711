"""A plain training script that checkpoints its per-rank state the way one of three users does.

Each rank holds `--state-mib` of its own state (a shard of a model and its optimizer, as with
FSDP or ZeRO), steps with one all_reduce plus `--step-sleep` seconds of "compute", and every
`--save-every` steps saves that state one of three ways (`--save`):

- `torch`: `torch.save` of the shard to the shared checkpoint directory with fsync, a barrier,
  then rank 0 records the step in `latest` (the usual global checkpoint);
- `local-sync`: `torch.save` of the shard to a node-local directory, no barrier; a restart
  resumes from the newest step every rank holds (NVRx's local checkpoint pattern: its own
  `LocalCheckpointManager` needs CUDA tensors, so this is that pattern with torch.save);
- `ftrun`: `ftrun.checkpointing.LocalCheckpointManager.save(..., is_async=True)` (node memory
  under ft_launcher).

A restart resumes from the checkpoint and checks the restored state (every tensor holds the
step it was saved at). One line per event goes to `<out>/rank<R>.log`:

    <ts> rank=<r> pid=<pid> step=<n> loss=0           (a step done)
    <ts> rank=<r> pid=<pid> save=<n> stall=<s>        (a save: seconds the step loop stopped)
    <ts> rank=<r> pid=<pid> restore=<n> took=<s>      (resumed from step n)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

TENSORS = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="step logs go here")
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="the shared directory")
    parser.add_argument("--save", choices=["torch", "local-sync", "ftrun"], required=True)
    parser.add_argument("--save-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--state-mib", type=int, default=256, help="per-rank state")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="s of 'compute' per step")
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument(
        "--replicate", action="store_true", help="ftrun: copy each part to the next node"
    )
    parser.add_argument(
        "--global-every", type=int, default=0, help="ftrun: a global save every N local ones"
    )
    parser.add_argument(
        "--memcpy-floor", action="store_true", help="log one timed copy of the state first"
    )
    return parser.parse_args()


class Saver:
    def after_step(self) -> None:
        """Work between steps (finishing background saves); none by default."""


def copy_into(state: list[torch.Tensor], loaded: list[torch.Tensor]) -> None:
    for dst, src in zip(state, loaded, strict=True):
        dst.copy_(src)


class TorchSave(Saver):
    """A global checkpoint: every rank's shard, fsynced, then `latest` names the step."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir, self.rank = directory, rank
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, state: list[torch.Tensor], step: int) -> None:
        path = self.dir / f"step{step}-rank{self.rank}.pt"
        with open(f"{path}.tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{path}.tmp", path)
        dist.barrier()
        if self.rank == 0:
            (self.dir / "latest.tmp").write_text(str(step))
            os.replace(self.dir / "latest.tmp", self.dir / "latest")
            for old in self.dir.glob("step*-rank*.pt"):
                if int(old.name[4:].split("-")[0]) < step:
                    old.unlink(missing_ok=True)

    def load_into(self, state: list[torch.Tensor]) -> int:
        latest = self.dir / "latest"
        if not latest.exists():
            return 0
        step = int(latest.read_text())
        copy_into(state, torch.load(self.dir / f"step{step}-rank{self.rank}.pt"))
        return step


class LocalSync(Saver):
    """Each rank's shard to a node-local directory; a restart takes the newest common step."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir, self.rank = directory, rank
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, state: list[torch.Tensor], step: int) -> None:
        path = self.dir / f"rank{self.rank}-step{step}.pt"
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        for old in self._steps()[:-2]:  # keep two: a peer may not have reached this one yet
            (self.dir / f"rank{self.rank}-step{old}.pt").unlink(missing_ok=True)

    def _steps(self) -> list[int]:
        return sorted(
            int(p.stem.split("step")[1]) for p in self.dir.glob(f"rank{self.rank}-step*.pt")
        )

    def load_into(self, state: list[torch.Tensor]) -> int:
        held = self._steps()
        newest = torch.tensor([max(held, default=0)])
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        step = int(newest)
        if step == 0 or step not in held:
            return 0
        copy_into(state, torch.load(self.dir / f"rank{self.rank}-step{step}.pt"))
        return step


class Ftrun(Saver):
    """ftrun's LocalCheckpointManager, async: the step loop waits only for the copy; with
    `global_every`, also an async global save through DCP every that many local saves, and a
    restart restores the newest copy of either tier, read straight into the state."""

    def __init__(self, local: Path, shared: Path, replicate: bool, global_every: int) -> None:
        from ftrun.checkpointing import (
            CliqueReplicationStrategy,
            GlobalCheckpointManager,
            LocalCheckpointManager,
        )

        strategy = None
        if replicate:  # a clique of 2: this rank and the same local rank on the next node
            jump = int(os.environ["LOCAL_WORLD_SIZE"])
            strategy = CliqueReplicationStrategy.from_replication_params(jump, 2)
        # Node memory and peers only, as these benches measured it before the copy on disk
        # became the default (NVRx writes its local tier to disk: see bench/RESULTS.md).
        self.manager = LocalCheckpointManager(
            str(local), repl_strategy=strategy, persist_to_disk=False
        )
        self.glob = GlobalCheckpointManager(shared) if global_every else None
        self.global_every, self.saves = global_every, 0

    def save(self, state: list[torch.Tensor], step: int) -> None:
        self.manager.save(named(state), step, is_async=True)
        self.saves += 1
        if self.glob is not None and self.saves % self.global_every == 0:
            self.glob.save(named(state), step)

    def after_step(self) -> None:
        if self.glob is not None:
            self.glob.maybe_finalize()

    def load_into(self, state: list[torch.Tensor]) -> int:
        from ftrun.checkpointing import CheckpointNotFoundError, restore

        tiers = [self.manager] + ([self.glob] if self.glob is not None else [])
        try:
            return restore(tiers, named(state)).iteration
        except CheckpointNotFoundError:
            return 0


def named(state: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's tensors under keys of its own (DCP saves equal keys of all ranks once)."""
    return {f"rank{dist.get_rank()}.t{i}": t for i, t in enumerate(state)}


def make_saver(args: argparse.Namespace, rank: int) -> TorchSave | LocalSync | Ftrun:
    node = os.environ.get("GROUP_RANK", "0")
    if args.save == "torch":
        return TorchSave(args.ckpt_dir / "global", rank)
    if args.save == "local-sync":
        return LocalSync(args.ckpt_dir / f"node{node}-local", rank)
    return Ftrun(
        args.ckpt_dir / f"node{node}-local", args.ckpt_dir / "global", args.replicate,
        args.global_every,
    )  # fmt: skip


def new_state(mib: int) -> list[torch.Tensor]:
    numel = mib * 2**20 // 4 // TENSORS
    return [torch.zeros(numel) for _ in range(TENSORS)]


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 (whole run)
    who = f"rank={rank} pid={os.getpid()}"

    saver = make_saver(args, rank)
    state = new_state(args.state_mib)
    if args.memcpy_floor:
        copies = [torch.empty_like(t) for t in state]
        for dst, src in zip(copies, state, strict=True):
            dst.copy_(src)  # faults the pages in, so the timed copy below is a plain memcpy
        began = time.perf_counter()
        for dst, src in zip(copies, state, strict=True):
            dst.copy_(src)
        print(f"{time.time():.6f} {who} memcpy={time.perf_counter() - began:.4f}", file=log)
        del copies
    began = time.perf_counter()
    start = saver.load_into(state)
    if start:
        if any(float(t[0]) != start for t in state):
            raise RuntimeError(f"restored state is not step {start}'s")
        print(f"{time.time():.6f} {who} restore={start} took={time.perf_counter() - began:.4f}",
              file=log)  # fmt: skip

    grad = torch.zeros(1024)
    for step in range(start + 1, args.steps + 1):
        dist.all_reduce(grad)
        time.sleep(args.step_sleep)
        state[step % TENSORS].fill_(step)  # the "optimizer step": the state changes every step
        for tensor in state:
            tensor[0] = step
        print(f"{time.time():.6f} {who} step={step} loss=0", file=log)
        saver.after_step()
        if step % args.save_every == 0:
            began = time.perf_counter()
            saver.save(state, step)
            print(f"{time.time():.6f} {who} save={step} stall={time.perf_counter() - began:.4f}",
                  file=log)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
