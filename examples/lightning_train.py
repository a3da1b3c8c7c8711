"""A small PyTorch Lightning training (CPU, DDP over gloo) with ftrun's Lightning callbacks.

Run it under ft_launcher (docs/lightning.md):

    ft_launcher --nnodes=1 --nproc-per-node=2 --max-restarts=3 \\
        --ft-prewarm-modules=torch,torch.distributed,pytorch_lightning \\
        examples/lightning_train.py --ckpt-dir /tmp/lt --max-steps 200

It uses:
- `FaultToleranceCallback`: heartbeats and sections for the launcher's hang detection, timeouts
  calculated and kept with the checkpoints, and `<ckpt-dir>/FINISHED` (or $FTRUN_FINISHED_FLAG)
  written when training is over (max steps, --max-time, --early-stop-below), never after a crash
  or a preemption;
- `PreemptionCallback`: on the launcher's SIGTERM, a checkpoint at a step end, then a clean stop;
- `HierarchicalCheckpointIO`: each rank's local checkpoint every --local-every steps (node memory
  under ft_launcher), global ones every --save-every steps in <ckpt-dir>/global, and a resume
  from the newest good copy of either;
- `StragglerDetectionCallback` with --straggler-interval (and --slow-rank to see one reported).

Each rank appends "<cycle> <first step> <what it resumed from>" to <ckpt-dir>/resume-rank<R>.txt
when training starts. Faults for drills and tests: --fault KIND:RANK:STEP[:CYCLE] (repeatable;
KIND is exception, kill or hang; CYCLE defaults to 0, the first cycle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ftrun.lightning import (
    FaultToleranceCallback,
    HierarchicalCheckpointIO,
    PreemptionCallback,
    StragglerDetectionCallback,
)

RANK = int(os.environ.get("RANK", "0"))
CYCLE = int(os.environ.get("FTRUN_CYCLE", "0"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--max-time", type=float, default=None, help="seconds of training")
    parser.add_argument("--early-stop-below", type=float, default=None, metavar="LOSS",
                        help="stop when the validation loss is below LOSS")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=10, help="global checkpoint, steps")
    parser.add_argument("--local-every", type=int, default=5, help="local ckpt, steps; 0: off")
    parser.add_argument("--val-every", type=int, default=20, help="validation, steps")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--width", type=int, default=64, help="hidden layer width")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fault", action="append", default=[], metavar="KIND:RANK:STEP[:CYCLE]")
    parser.add_argument("--straggler-interval", type=float, default=0.0, help="seconds; 0: off")
    parser.add_argument("--slow-rank", default="", metavar="RANK:FACTOR",
                        help="RANK's --step-time is FACTOR times longer")  # fmt: skip
    parser.add_argument("--no-ftrun", action="store_true", help="no ftrun callbacks (baseline)")
    parser.add_argument("--timing", type=Path, help="rank 0 writes its step intervals here")
    return parser.parse_args(argv)


class Regression(pl.LightningModule):
    """An MLP fitting a fixed random linear map; `step_time` pads each step (seconds)."""

    def __init__(self, width: int, step_time: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 1))
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_time:
            time.sleep(self.step_time)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data(samples: int, batch_size: int, seed: int) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=gen)
    y = x @ torch.linspace(-1, 1, 32).unsqueeze(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=gen)


class ResumeLog(pl.Callback):
    """Appends "<cycle> <first step> <resumed from>" to <dir>/resume-rank<R>.txt."""

    def __init__(self, directory: Path, io: HierarchicalCheckpointIO | None) -> None:
        self.path = directory / f"resume-rank{RANK}.txt"
        self.io = io

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        source = (self.io.loaded_from if self.io else None) or "scratch"
        with self.path.open("a") as out:
            out.write(f"{CYCLE} {trainer.global_step} {source}\n")


class StepTimer(pl.Callback):
    """Rank 0 writes the wall time between consecutive training-step ends to `path` (JSON)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            gaps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
            self.path.write_text(json.dumps({"intervals": gaps}))


def callbacks(args: argparse.Namespace, io: HierarchicalCheckpointIO | None) -> list[pl.Callback]:
    found: list[pl.Callback] = [
        ModelCheckpoint(dirpath=args.ckpt_dir / "global", filename="{step}", monitor="step",
                        mode="max", save_top_k=2, every_n_train_steps=args.save_every),
        ResumeLog(args.ckpt_dir, io),
    ]  # fmt: skip
    if args.timing:
        found.append(StepTimer(args.timing))
    if args.early_stop_below is not None:
        found.append(EarlyStopping("val_loss", stopping_threshold=args.early_stop_below))
    if io is None:
        return found
    found += [
        FaultToleranceCallback(exp_dir=args.ckpt_dir, simulated_fault=args.fault),
        PreemptionCallback(),
    ]
    if args.local_every:
        found.append(io.callback())
    if args.straggler_interval:
        found.append(straggler_callback(args.straggler_interval))
    return found


def straggler_callback(interval: float) -> pl.Callback:
    return StragglerDetectionCallback(
        report_time_interval=interval,
        calc_relative_gpu_perf=True,
        calc_individual_gpu_perf=True,
        num_gpu_perf_scores_to_print=4,
        gpu_relative_perf_threshold=0.7,
        gpu_individual_perf_threshold=0.7,
        stop_if_detected=False,
    )


def step_time(args: argparse.Namespace) -> float:
    if args.slow_rank:
        rank, factor = args.slow_rank.split(":")
        if int(rank) == RANK:
            return args.step_time * float(factor)
    return args.step_time


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[rank {RANK}] %(name)s: %(message)s")
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    io = None if args.no_ftrun else HierarchicalCheckpointIO(
        args.ckpt_dir / "local", every_n_train_steps=args.local_every or 1
    )  # fmt: skip
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local_size,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local_size,
        strategy=DDPStrategy(process_group_backend="gloo"),
        plugins=[io] if io else None,
        callbacks=callbacks(args, io),
        max_steps=args.max_steps,
        max_time=None if args.max_time is None else {"seconds": args.max_time},
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.ckpt_dir,
    )
    model = Regression(args.width, step_time(args))
    resume = io.resume_path(args.ckpt_dir / "global") if io else None
    trainer.fit(model, data(8192, args.batch_size, 0), data(256, 64, 1), ckpt_path=resume)
    print(f"rank {RANK}: fit returned at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
