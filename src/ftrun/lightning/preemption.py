"""`PreemptionCallback`: on the launcher's SIGTERM, save a checkpoint at a step end and stop.

ft_launcher forwards SIGTERM/SIGINT (Slurm's preemption or time limit, `scancel --signal=TERM`)
to every worker, waits `--workers-stop-timeout` (15 s by default) and then SIGKILLs them, and
exits 75 ("relaunch me"). Within that window this callback:

1. records the signal (the handler only sets a flag: no logging, no collectives);
2. at a step end, the ranks agree whether any of them has seen it: one all-reduce (MAX) on a
   gloo group of their own, issued at a step end and read a few steps later, so it overlaps
   training and never waits on a peer. They agree every `check_interval` seconds (0.1 s) or
   every step when steps are longer: the fit stops on every rank at the same step end, within
   about two intervals (or two steps) of the signal, well inside the stop timeout. A vote at
   every step cost the 8 ms steps of examples/lightning_train.py about 1 ms on a 2-core
   machine; this costs a median 5 us per step there;
3. saves a checkpoint with `trainer.save_checkpoint` (every rank calls it; the strategy writes)
   to `checkpoint_path`, by default `last-preempted.ckpt` in the `ModelCheckpoint`'s directory,
   a name `fit(ckpt_path="last")` considers;
4. stops through `ending.request_stop`: `fit` returns normally after this step, and the
   finished flag is not written (training was interrupted, not finished).

Lightning installs its own SIGTERM handler, which runs a `dist.broadcast` inside the handler (a
collective at whatever point the signal lands, out of order with the step's own collectives);
this callback replaces it while training runs and puts it back at the end of training.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ftrun.lightning._compat import Callback
from ftrun.lightning.ending import request_stop
from ftrun.lightning.errors import LightningUsageError
from ftrun.lightning.vote import StopVote

log = logging.getLogger("ftrun.lightning")

DEFAULT_FILENAME = "last-preempted.ckpt"


class PreemptionCallback(Callback):
    """Checkpoint and stop cleanly when `sig` arrives (default SIGTERM, what ft_launcher sends).

    `checkpoint_path`: where to save; by default `last-preempted.ckpt` in the directory of the
    trainer's `ModelCheckpoint` (one of the two is required). `check_interval`: seconds between
    the ranks' agreements on a stop, at most (every step when steps are longer).
    """

    def __init__(
        self,
        sig: signal.Signals | int = signal.SIGTERM,
        checkpoint_path: str | Path | None = None,
        check_interval: float = 0.1,
    ) -> None:
        if not isinstance(check_interval, (int, float)) or not 0 < check_interval <= 60:
            raise LightningUsageError(f"check_interval must be in (0, 60] s: {check_interval!r}")
        try:
            self.sig = signal.Signals(sig)
        except ValueError:
            raise LightningUsageError(f"not a signal: {sig!r}") from None
        if self.sig in (signal.SIGKILL, signal.SIGSTOP):
            raise LightningUsageError(f"{self.sig.name} cannot be caught")
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
        self.preempted = False
        self.saved_path: Path | None = None
        self._received = False
        self._previous: Any = None
        self._installed = False
        self._vote = StopVote(float(check_interval))

    @property
    def received(self) -> bool:
        """This rank has received the signal (before the ranks agreed on it)."""
        return self._received

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.checkpoint_path is None and trainer.checkpoint_callback is None:
            raise LightningUsageError(
                "PreemptionCallback needs checkpoint_path= or a ModelCheckpoint callback"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.preempted = False
        self._received = False
        self._vote.open()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.sig, self._on_signal)
            self._installed = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.preempted or not self._vote.poll(trainer.global_step, self._received):
            return
        self.preempted = True
        path = self._path(trainer)
        log.info("preemption: %s received; saving %s at step %d",
                 self.sig.name, path, trainer.global_step)  # fmt: skip
        trainer.save_checkpoint(path)
        self.saved_path = path
        request_stop(trainer, f"{self.sig.name} (preemption)")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._uninstall()
        self._vote.close(drain=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._uninstall()
        self._vote.close(drain=False)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = True  # only this: the step end acts on it

    def _uninstall(self) -> None:
        if self._installed:
            signal.signal(self.sig, self._previous)
            self._installed = False

    def _path(self, trainer: Any) -> Path:
        if self.checkpoint_path is not None:
            return self.checkpoint_path
        dirpath = trainer.checkpoint_callback.dirpath
        if dirpath is None:
            raise LightningUsageError("the ModelCheckpoint has no dirpath: give checkpoint_path=")
        return Path(dirpath) / DEFAULT_FILENAME
