"""NVRx's form of `HierarchicalCheckpointIO`: `(wrapped_checkpoint_io, local_ckpt_manager,
get_global_ckpt_iteration_fn, async_save=False)`, kept apart from ftrun's own.

In that form the user builds the `LocalCheckpointManager`, local saves arrive as
`trainer.save_checkpoint(None, storage_options={LOCAL_CKPT_OPTS_KEY: {"iteration": step}})`
(NVRx's `LocalCheckpointCallback` does that; ftrun's saves on every rank instead, see
`local_callback`), and `load_checkpoint(path)` follows NVRx's rule: the local checkpoint when
its iteration is at least `get_global_ckpt_iteration_fn(path)`, else the global file.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrun.lightning._compat import CheckpointIO
from ftrun.lightning.errors import LightningUsageError

log = logging.getLogger("ftrun.lightning")

LOCAL_CKPT_OPTS_KEY = "local_checkpoint_options"
"""NVRx's key, in `storage_options`, of a local save's options (`iteration`, `is_async`)."""


def is_nvrx_form(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    first = args[0] if args else kwargs.get("wrapped_checkpoint_io")
    return isinstance(first, CheckpointIO) or "local_ckpt_manager" in kwargs


def init_nvrx_form(
    io: Any,
    wrapped_checkpoint_io: Any,
    local_ckpt_manager: Any,
    get_global_ckpt_iteration_fn: Any,
    async_save: bool = False,
) -> None:
    if local_ckpt_manager is None:
        raise LightningUsageError("HierarchicalCheckpointIO (NVRx's form) needs local_ckpt_manager")
    if not callable(get_global_ckpt_iteration_fn):
        raise LightningUsageError("get_global_ckpt_iteration_fn must be callable")
    io.checkpoint_io = wrapped_checkpoint_io
    io.manager = local_ckpt_manager
    io.get_global_ckpt_iteration_fn = get_global_ckpt_iteration_fn
    io.async_save = bool(async_save)
    io.every_n_train_steps = None  # the callback's (NVRx's LocalCheckpointCallback) to say


def local_options(storage_options: Any) -> Mapping[str, Any] | None:
    """A local save's options in `storage_options`, or None for a global save."""
    if not isinstance(storage_options, Mapping) or LOCAL_CKPT_OPTS_KEY not in storage_options:
        return None
    options = storage_options[LOCAL_CKPT_OPTS_KEY]
    if not isinstance(options, Mapping) or type(options.get("iteration")) is not int:
        raise LightningUsageError(
            f"storage_options[{LOCAL_CKPT_OPTS_KEY!r}] needs an int 'iteration', not {options!r}"
        )
    return options


def load_newer(
    io: Any, path: Any, map_location: Any, weights_only: bool | None, **kwargs: Any
) -> dict[str, Any]:
    """NVRx's rule: the local checkpoint if it is at least as new as the global one at `path`."""
    local = io.manager.find_latest()
    if local >= 0:
        global_iteration = io.get_global_ckpt_iteration_fn(path)
        if local >= global_iteration:
            log.info("resuming from local iteration %d (global: %s)", local, global_iteration)
            if (loaded := io._try_local(**kwargs)) is not None:
                return loaded
        else:
            log.warning("local iteration %d is older than the global %s: loading %s",
                        local, global_iteration, path)  # fmt: skip
    return io._load_global(Path(path), map_location, weights_only)
