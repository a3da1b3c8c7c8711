"""An `overlap` save's copies (`LocalCheckpointManager.save(overlap=True)`), made while the
caller's next step runs.

The caller only marks where it is: `OverlappedCopy()` records a CUDA event on its current stream
(when CUDA is in use). Everything else runs in the save's background thread: flattening the
state and planning the part, mapping its file (`defer_copy`), queueing the CUDA tensors' copies
on a side stream that first waits for that event (so they copy the values as of the save, in
page-locked node memory), and copying the host tensors. Then it sets `copied`, waits for the
device copies, and the part is committed as any other.

The caller's next in-place change must come after the copies: `fence()` waits (on the host)
until the background thread has queued the device copies and made the host ones, then makes
the caller's current stream wait for the device copies, without a host wait. The background
thread has a whole forward and backward pass for its part, so the fence rarely waits.

A value the part cannot hold (`CheckpointFormatError`) is raised by the next `save` or `wait`,
not by the `save` that was given it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ftrun.checkpointing.store import PartKey, PartStore, PreparedPart


class OverlappedCopy:
    """One overlapped save's copies; see the module docstring."""

    def __init__(self) -> None:
        self._after = _caller_position()
        self._copied = threading.Event()
        self._device_done: Any = None

    def prepare(
        self, store: PartStore, key: PartKey, state: Any, metadata: Mapping[str, str]
    ) -> PreparedPart:
        """In the background thread: the part, its tensors copied (the device ones landed)."""
        try:
            pending = store.prepare(key, state, metadata, defer_copy=True)
        except BaseException:
            self._copied.set()
            raise
        try:
            try:
                self._device_done = pending.queue_device_copies(self._after)
                pending.copy_host_tensors()
            finally:
                self._copied.set()
            if self._device_done is not None:
                self._device_done.synchronize()
        except BaseException:
            pending.abort()
            raise
        return pending

    def abandon(self) -> None:
        """The background thread never started: nothing to wait for."""
        self._copied.set()

    def fence(self) -> None:
        self._copied.wait()
        if self._device_done is not None:
            torch.cuda.current_stream().wait_event(self._device_done)


def _caller_position() -> Any:
    """A CUDA event on the caller's current stream, or None where CUDA is not in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event
