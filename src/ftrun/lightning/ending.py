"""How a fit ended, and the finished flag: the completion contract with `slurm/`.

The Slurm template relaunches a job until a flag file exists (`slurm/README.md`, "The finished
flag is the completion contract"). The flag must appear when, and only when, training is over:

- written when `fit` returned normally and training reached its end: `max_steps`, `max_epochs`,
  `max_time` (Lightning's `Timer`), early stopping, any other `trainer.should_stop` (a user's
  own stop), or no training batches at all;
- never after an exception (a crash, a peer's death, Lightning's own SIGTERM exit), nor after a
  stop that only interrupts training: `request_stop(trainer, reason)` (preemption, a straggler
  stop) sets `should_stop` *and* records that the stop is not the end. A limit already reached
  wins over an interruption: the work is done.

NVRx's callback recognised only `max_steps`/`max_epochs`, so a `max_time` or early-stopped run
was relaunched forever; this module keeps every rule in one place, unit-tested with a Trainer.

Where the flag goes: `$FTRUN_FINISHED_FLAG` when set (the Slurm template's resolved
`--ft-finished-flag`), else `<exp_dir>/FINISHED`, where `exp_dir` defaults to the trainer's
`default_root_dir`.
"""

from __future__ import annotations

import enum
import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

from ftrun.environment import Env
from ftrun.lightning._compat import EarlyStopping, Timer
from ftrun.owned_dir import replace_file

FLAG_NAME = "FINISHED"

_interruptions: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class Ending(str, enum.Enum):
    """Why a fit ended. Every member but INTERRUPTED and FAILED means training is finished."""

    MAX_STEPS = "max_steps"
    MAX_EPOCHS = "max_epochs"
    MAX_TIME = "max_time"
    EARLY_STOPPING = "early_stopping"
    STOPPED = "should_stop"
    NO_DATA = "no_training_batches"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self not in (Ending.INTERRUPTED, Ending.FAILED)


def request_stop(trainer: Any, reason: str) -> None:
    """Stop at the end of this step without marking training finished (preemption, stragglers).
    Call it on every rank, in the same step: Lightning stops when any rank asks."""
    _interruptions[trainer] = reason
    trainer.should_stop = True


def interruption(trainer: Any) -> str | None:
    """The reason given to `request_stop` for this trainer, or None."""
    return _interruptions.get(trainer)


def classify(trainer: Any, failed: bool = False) -> Ending:
    """Why the fit of `trainer` ended; `failed`: it ended by an exception."""
    if failed:
        return Ending.FAILED
    if 0 <= trainer.max_steps <= trainer.global_step:
        return Ending.MAX_STEPS
    max_epochs = trainer.max_epochs
    if max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch:
        return Ending.MAX_EPOCHS
    if trainer in _interruptions:
        return Ending.INTERRUPTED
    if any(isinstance(cb, Timer) and _out_of_time(cb) for cb in trainer.callbacks):
        return Ending.MAX_TIME
    if not trainer.should_stop:
        return Ending.NO_DATA
    if any(isinstance(cb, EarlyStopping) for cb in trainer.callbacks):
        return Ending.EARLY_STOPPING  # EarlyStopping's stopped_epoch is 0 when it stops in epoch 0
    return Ending.STOPPED


def _out_of_time(timer: Any) -> bool:
    remaining = timer.time_remaining()
    return remaining is not None and remaining <= 0


def finished_flag_path(exp_dir: str | Path | None, default_root_dir: str | Path) -> Path:
    """Where the finished flag goes (see the module docstring)."""
    if env := os.environ.get(Env.FINISHED_FLAG):
        return Path(env)
    return Path(exp_dir if exp_dir is not None else default_root_dir) / FLAG_NAME


def write_finished_flag(path: Path, ending: Ending, trainer: Any) -> None:
    """Create the flag atomically (temp file, rename) with what ended the training in it."""
    record = {
        "ending": ending.value,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "time": time.time(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, json.dumps(record) + "\n")
