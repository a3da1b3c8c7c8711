"""Writing one checkpoint part, atomically (what a part is, and reading it back: `format`).

Writing, `write_part` = `prepare_part` + `PendingPart.commit`:

1. `prepare_part` flattens the state and plans the layout (nothing on disk yet: a value that
   cannot be stored fails here), creates `<path>.tmp-<pid>`, reserves its full size with
   `posix_fallocate`, maps it, and copies every tensor into a typed view of the mapping: one
   copy, with torch gathering non-contiguous tensors and doing the device-to-host copy of CUDA
   tensors on the way (into a kept mapping, page-locked once: see `pinning`). After it returns,
   the part owns its bytes: the caller may change its tensors.
2. `commit` computes the CRC-32C of each tensor from the mapping (what landed in the file), writes
   the header, flushes and fsyncs the file, renames it to `path` and fsyncs the directory.

Why reserve with `posix_fallocate` rather than only `ftruncate`: a store through a shared mapping
into a file with no blocks behind it gets SIGBUS when the filesystem is full (tmpfs especially),
which kills the process instead of raising. With the blocks reserved up front, a full disk is an
ENOSPC from `posix_fallocate`, while we can still clean up.

Why no fsync under /dev/shm: tmpfs has no backing device; its files live exactly as long as the
machine's memory, so msync/fsync would buy nothing and still walk every page. The rename is what
makes the part appear whole, on tmpfs and on disks alike.

On any failure the temp file is removed and `CheckpointWriteError` is raised (one line); the
part already at `path`, if any, and parts at other paths are never touched.

Deferred copies (`defer_copy`, for `LocalCheckpointManager.save(overlap=True)`): `prepare_part`
only plans and maps; `queue_device_copies` then queues the CUDA tensors' copies on a side stream
(into a page-locked mapping; otherwise it copies them at once, as the caller's values must be
the ones saved), and `copy_host_tensors` copies the rest, from another thread if the caller likes:
the training goes on while the bytes move.

Reusing an old part's memory: a store may hand `prepare_part` the `Recycled` file of a part it
retired, still mapped from when this process wrote it (`keep_mapping`): the copy then lands in
pages that are already there, at memcpy speed (see `recycled` for why and when). The retired file
is renamed to the temp name first: nobody finds it under a part's name while it is rewritten.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ftrun.checkpointing import pinning
from ftrun.checkpointing.errors import CheckpointUsageError, CheckpointWriteError
from ftrun.checkpointing.flatten import Flat, flatten
from ftrun.checkpointing.format import TMP_MARK, PartInfo, checksums
from ftrun.checkpointing.layout import (
    KEY_ITERATION,
    PREFIX_BYTES,
    RESERVED,
    Layout,
    encode_header,
    plan,
)
from ftrun.checkpointing.persist import fsync_dir, reserve
from ftrun.checkpointing.recycled import Recycled, open_recycled

_VOLATILE_ROOTS = ("/dev/shm/", "/run/shm/")
_PathLike = str | os.PathLike[str]


class PendingPart:
    """A part whose tensor bytes are in its temp file; nothing exists at `path` until `commit`.

    Call `commit` (it aborts itself on failure) or `abort`, once. With `keep_mapping`, the
    file stays mapped after `commit` (`kept_mapping`), for a later `Recycled`.
    """

    def __init__(
        self,
        path: Path,
        tmp: Path,
        fd: int,
        mapping: mmap.mmap,
        layout: Layout,
        keep_mapping: bool = False,
        uncopied: Sequence[torch.Tensor] = (),
    ) -> None:
        self.path = path
        self._tmp = tmp
        self._fd = fd
        self._mm: mmap.mmap | None = mapping
        self._layout = layout
        self._durable = not _is_volatile(path)
        self._keep = keep_mapping
        self.kept_mapping: mmap.mmap | None = None
        self._uncopied = dict(enumerate(uncopied))
        """`defer_copy`: the tensors still to copy, by entry."""

    def queue_device_copies(self, after: Any = None) -> Any:
        """Copy the CUDA tensors of a deferred part: queued on a side stream of their device,
        after the `after` event (default: the work queued so far on the current stream) when the
        mapping can be page-locked, else at once (after `after`). Returns the `torch.cuda.Event`
        that marks the queued copies' end, or None when nothing was queued."""
        on_device = {i: t for i, t in self._uncopied.items() if t.is_cuda}
        if not on_device:
            return None
        mm = self._require_mapping()
        for i in on_device:
            del self._uncopied[i]
        device = next(iter(on_device.values())).device
        if not (self._keep and not self._durable and pinning.pin(mm, device)):
            if after is not None:
                after.synchronize()
            _copy_entries(mm, self._layout, on_device)
            return None
        stream = _side_stream(device)
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(device))
        else:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for tensor in on_device.values():
                tensor.record_stream(stream)  # its memory is not reused before the copy ran
            _copy_entries(mm, self._layout, on_device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def copy_host_tensors(self) -> None:
        """Copy what `queue_device_copies` left: the host tensors of a deferred part."""
        uncopied, self._uncopied = self._uncopied, {}
        _copy_entries(self._require_mapping(), self._layout, uncopied)

    def commit(self) -> PartInfo:
        """Checksum, write the header, make the file durable, and rename it into place. A
        deferred part's copies must have landed (`copy_host_tensors`, the device event)."""
        layout = self._layout
        try:
            mm = self._require_mapping()
            if self._uncopied:
                raise CheckpointUsageError(f"{self.path}: committed before its tensors were copied")
            crcs = checksums(mm, layout.data_start, layout.entries)
            header = encode_header(layout, crcs)
            mm[:PREFIX_BYTES] = struct.pack("<Q", len(header))
            mm[PREFIX_BYTES : layout.data_start] = header
            if self._durable:
                mm.flush()
                os.fsync(self._fd)
            self.kept_mapping = mm if self._keep else None
            self._release(unmap=not self._keep)
            os.replace(self._tmp, self.path)
            if self._durable:
                fsync_dir(self.path.parent)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise _write_error(self.path, e) from e
            raise
        user = {k: v for k, v in layout.metadata.items() if not k.startswith(RESERVED)}
        return PartInfo(path=str(self.path), iteration=int(layout.metadata[KEY_ITERATION]),
                        nbytes=layout.total, tensor_count=len(layout.entries),
                        tensor_bytes=layout.data_size, checksums_verified=True,
                        metadata=MappingProxyType(user))  # fmt: skip

    def abort(self) -> None:
        """Drop the temp file; the part at `path`, if any, stays as it was."""
        self._release(unmap=False)
        self._tmp.unlink(missing_ok=True)

    def _require_mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise CheckpointUsageError(f"{self.path}: this pending part was already finished")
        return self._mm

    def _release(self, unmap: bool = True) -> None:
        """Close the file; `unmap=False` (error paths) leaves unmapping to the last reference."""
        if self._mm is not None and unmap:
            self._mm.close()
        self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_part(
    path: _PathLike, state: Any, iteration: int, metadata: Mapping[str, str] | None = None
) -> PartInfo:
    """Write `state` as the part at `path`, atomically (see the module docstring)."""
    return prepare_part(path, state, iteration, metadata).commit()


def prepare_part(
    path: _PathLike,
    state: Any,
    iteration: int,
    metadata: Mapping[str, str] | None = None,
    recycled: Recycled | None = None,
    keep_mapping: bool = False,
    defer_copy: bool = False,
) -> PendingPart:
    """Copy `state` into a temp file next to `path`; `commit` the result to make it the part.

    `recycled`: a retired part's file to write into instead of a new one (used if big enough).
    `defer_copy`: map the file but copy nothing yet (see the module docstring).
    """
    if type(iteration) is not int or iteration < 0:
        raise CheckpointUsageError(f"iteration must be a non-negative int, not {iteration!r}")
    path = Path(path)
    flat, layout = planned(state, iteration, metadata)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    fd, mapping = -1, None
    try:
        fd, mapping = open_recycled(recycled, tmp, layout.total) if recycled else (-1, None)
        if mapping is None:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            reserve(fd, layout.total)
            mapping = pinning.Mapping(fd, layout.total)
        if not defer_copy:
            _copy_tensors(mapping, layout, flat.tensors, pin=keep_mapping and _is_volatile(path))
    except BaseException as e:
        # Not mapping.close(): views of it may live on in the traceback's frames, and torch
        # views do not pin a buffer export. Dropping our reference unmaps it once they are gone.
        mapping = None
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _write_error(path, e) from e
        raise
    uncopied = flat.tensors if defer_copy else ()
    return PendingPart(path, tmp, fd, mapping, layout, keep_mapping, uncopied)


def planned(
    state: Any, iteration: int, metadata: Mapping[str, str] | None = None
) -> tuple[Flat, Layout]:
    """`state` taken apart, and the layout of its part."""
    flat = flatten(state)
    return flat, plan(flat.tensors, json.dumps(flat.skeleton, allow_nan=False), iteration, metadata)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """The one copy of a tensor's bytes into the file (a seam for tests to fail)."""
    dst.copy_(src, non_blocking=non_blocking)


def _copy_tensors(
    mapping: mmap.mmap, layout: Layout, tensors: Sequence[torch.Tensor], pin: bool = False
) -> None:
    """With `pin` (a kept mapping) and CUDA tensors, the mapping is page-locked and their
    copies are queued, then waited for: complete when this returns, as the others are."""
    devices = pinning.cuda_devices(tensors) if pin else []
    pinned = bool(devices) and pinning.pin(mapping, devices[0])
    try:
        _copy_entries(mapping, layout, dict(enumerate(tensors)), non_blocking=pinned)
    finally:
        if pinned:  # also on errors: no DMA may still land in a mapping being dropped
            pinning.synchronize(devices)


def _copy_entries(
    mapping: mmap.mmap,
    layout: Layout,
    tensors: Mapping[int, torch.Tensor],
    non_blocking: bool = False,
) -> None:
    """Copy each tensor into its entry's bytes (`non_blocking` applies to CUDA tensors)."""
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # must not outlive the mapping
    for index, tensor in tensors.items():
        entry = layout.entries[index]
        if entry.end > entry.begin:
            span = whole[layout.data_start + entry.begin : layout.data_start + entry.end]
            dst = span.view(entry.dtype).view(entry.shape)
            _copy_into(dst, tensor, non_blocking=non_blocking and tensor.is_cuda)


@functools.cache
def _side_stream(device: torch.device) -> Any:
    """The stream every deferred part's copies from `device` are queued on."""
    return torch.cuda.Stream(device)


def _is_volatile(path: Path) -> bool:
    return (os.path.realpath(path.parent) + "/").startswith(_VOLATILE_ROOTS)


def _write_error(path: Path, error: OSError) -> CheckpointWriteError:
    return CheckpointWriteError(f"cannot write checkpoint part {path}: {error.strerror or error}")
