"""`LocalCheckpointCallback`: triggers `HierarchicalCheckpointIO`'s local saves.

Two forms. ftrun's, `LocalCheckpointCallback(io)` (what `io.callback()` returns), saves every
`io.every_n_train_steps` steps. NVRx's, `LocalCheckpointCallback(every_n_train_steps=None,
train_time_interval=None)`, finds the IO on the trainer's strategy (`plugins=[io]`) and saves
every N steps and/or once `train_time_interval` (a `timedelta`) has passed since the last save,
NVRx's two triggers. Either way every rank saves its own copy at the end of the step, from
`trainer._checkpoint_connector.dump_checkpoint()`: Lightning's `trainer.save_checkpoint`, which
NVRx's callback calls, reaches the IO on rank 0 only under DDP, so no iteration would ever be
complete on every rank.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from ftrun.lightning._compat import Callback
from ftrun.lightning.errors import LightningUsageError


class LocalCheckpointCallback(Callback):
    """See the module docstring."""

    def __init__(
        self,
        io: Any = None,
        train_time_interval: timedelta | None = None,
        *,
        every_n_train_steps: int | None = None,
    ) -> None:
        if isinstance(io, int) and not isinstance(io, bool):  # NVRx's positional steps
            io, every_n_train_steps = None, io
        if every_n_train_steps is not None and (
            type(every_n_train_steps) is not int or every_n_train_steps < 1
        ):
            raise LightningUsageError(
                f"every_n_train_steps must be an int >= 1, not {every_n_train_steps!r}"
            )
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise LightningUsageError(
                f"train_time_interval must be a timedelta, not {train_time_interval!r}"
            )
        self.io = io
        self.every_n_train_steps = every_n_train_steps
        self.train_time_interval = train_time_interval
        self._last_step = -1
        self._last_save = time.monotonic()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.io is not None:
            return
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if not callable(getattr(io, "save_local", None)):  # a HierarchicalCheckpointIO
            raise LightningUsageError(
                "LocalCheckpointCallback needs a HierarchicalCheckpointIO in the trainer's "
                f"plugins, not {type(io).__name__}"
            )
        self.io = io

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step or not self._due(step) or self.io.skips_now():
            return
        self._last_step, self._last_save = step, time.monotonic()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.io.save_local(checkpoint, step)

    def _due(self, step: int) -> bool:
        every = self.every_n_train_steps
        if every is None and self.train_time_interval is None:
            every = getattr(self.io, "every_n_train_steps", None)
        if every is not None and step % every == 0:
            return True
        interval = self.train_time_interval
        return (
            interval is not None and time.monotonic() - self._last_save >= interval.total_seconds()
        )
