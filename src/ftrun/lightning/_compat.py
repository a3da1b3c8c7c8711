"""Which Lightning: `lightning.pytorch` (the `lightning` package) or `pytorch_lightning`.

A Trainer only accepts callbacks and plugins of its own package, so ftrun's classes must derive
from the one the user trains with. `FTRUN_LIGHTNING_PACKAGE` picks it (`lightning` or
`pytorch_lightning`); by default the `lightning` package when installed, else
`pytorch_lightning` (what `pip install ftrun[lightning]` installs).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

from ftrun.environment import Env

_CHOICES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def _root() -> ModuleType:
    wanted = os.environ.get(Env.LIGHTNING_PACKAGE, "")
    if wanted and wanted not in _CHOICES:
        raise ImportError(f"{Env.LIGHTNING_PACKAGE}={wanted!r}: not one of {', '.join(_CHOICES)}")
    order = [wanted] if wanted else ["lightning", "pytorch_lightning"]
    for name in order:
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(_CHOICES[name])
    raise ImportError(
        "ftrun.lightning needs PyTorch Lightning: pip install 'ftrun[lightning]'"
        " (or the `lightning` package)"
    )


pl = _root()
Callback = pl.Callback
LightningModule = pl.LightningModule
Trainer = pl.Trainer
ModelCheckpoint = pl.callbacks.ModelCheckpoint
EarlyStopping = pl.callbacks.EarlyStopping
Timer = pl.callbacks.Timer
CheckpointIO = pl.plugins.CheckpointIO
TorchCheckpointIO = pl.plugins.TorchCheckpointIO

__all__ = [
    "Callback",
    "CheckpointIO",
    "EarlyStopping",
    "LightningModule",
    "ModelCheckpoint",
    "Timer",
    "TorchCheckpointIO",
    "Trainer",
    "pl",
]
