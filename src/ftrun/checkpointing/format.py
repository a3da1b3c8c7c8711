"""Writing and reading one checkpoint part (one rank's state at one iteration), without pickle.

The bytes are laid out as `layout` describes (safetensors' layout); the state's structure is the
JSON skeleton of `flatten`. Reading never uses pickle, `torch.load` or `eval`.

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

Reusing an old part's memory: a store may hand `prepare_part` the `Recycled` file of a part it
retired, still mapped from when this process wrote it (`keep_mapping`): the copy then lands in
pages that are already there, at memcpy speed (see `recycled` for why and when). The retired file
is renamed to the temp name first: nobody finds it under a part's name while it is rewritten.

Reading, `read_part`, maps the file copy-on-write (`mmap.ACCESS_COPY`) and builds the tensors
on the mapping with `torch.frombuffer`: zero-copy. The pages are shared with the page cache
(on /dev/shm: with the file itself) until a tensor is written to; a write copies just that page
into private memory and never reaches the file. The tensors keep the mapping alive (and with it
the file's memory, even once the file is removed): drop the loaded state once it has been copied
into the model and optimizer. Files are only ever replaced by rename, never rewritten in place,
so a mapping never sees its bytes change under it.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ftrun.checkpointing import pinning
from ftrun.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointUsageError,
    CheckpointWriteError,
)
from ftrun.checkpointing.flatten import flatten, unflatten
from ftrun.checkpointing.layout import (
    KEY_ITERATION,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    RESERVED,
    Entry,
    Header,
    Layout,
    checksum,
    decode_header,
    encode_header,
    plan,
)
from ftrun.checkpointing.recycled import Recycled, open_recycled

TMP_MARK = ".tmp-"
_PARALLEL_CRC_BYTES = 64 * 2**20
CRC_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))
_VOLATILE_ROOTS = ("/dev/shm/", "/run/shm/")
_PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class PartInfo:
    """What a part holds, from its header. `checksums_verified` says whether every tensor's
    CRC was checked (writes compute them; `read_info` reads only the header)."""

    path: str
    iteration: int
    nbytes: int
    tensor_count: int
    tensor_bytes: int
    checksums_verified: bool
    metadata: Mapping[str, str]


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
    ) -> None:
        self.path = path
        self._tmp = tmp
        self._fd = fd
        self._mm: mmap.mmap | None = mapping
        self._layout = layout
        self._durable = not _is_volatile(path)
        self._keep = keep_mapping
        self.kept_mapping: mmap.mmap | None = None

    def commit(self) -> PartInfo:
        """Checksum, write the header, make the file durable, and rename it into place."""
        layout = self._layout
        try:
            mm = self._require_mapping()
            crcs = _checksums(mm, layout.data_start, layout.entries)
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
                _fsync_dir(self.path.parent)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise _write_error(self.path, e) from e
            raise
        return PartInfo(
            path=str(self.path),
            iteration=int(layout.metadata[KEY_ITERATION]),
            nbytes=layout.total,
            tensor_count=len(layout.entries),
            tensor_bytes=layout.data_size,
            checksums_verified=True,
            metadata=MappingProxyType(
                {k: v for k, v in layout.metadata.items() if not k.startswith(RESERVED)}
            ),
        )

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
) -> PendingPart:
    """Copy `state` into a temp file next to `path`; `commit` the result to make it the part.

    `recycled`: a retired part's file to write into instead of a new one (used if big enough).
    """
    if type(iteration) is not int or iteration < 0:
        raise CheckpointUsageError(f"iteration must be a non-negative int, not {iteration!r}")
    path = Path(path)
    flat = flatten(state)
    layout = plan(flat.tensors, json.dumps(flat.skeleton, allow_nan=False), iteration, metadata)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    fd, mapping = -1, None
    try:
        fd, mapping = open_recycled(recycled, tmp, layout.total) if recycled else (-1, None)
        if mapping is None:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            _reserve(fd, layout.total)
            mapping = pinning.Mapping(fd, layout.total)
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
    return PendingPart(path, tmp, fd, mapping, layout, keep_mapping)


def read_part(path: _PathLike, verify: bool = True) -> tuple[Any, PartInfo]:
    """Load the part at `path`: tensors are zero-copy, copy-on-write views of the file.

    With `verify`, every tensor's CRC is checked first (this reads the whole file once).
    Raises `CheckpointNotFoundError` if there is no file, `CheckpointCorruptError` if it is
    truncated, altered, or not an ftrun part.
    """
    path = Path(path)
    fd, size, header = open_for_read(path)
    try:
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise _unreadable(path, e) from e
    finally:
        os.close(fd)
    data_start = PREFIX_BYTES + header.header_len
    if verify:
        found = _checksums(mapping, data_start, header.entries)
        for entry, crc, got in zip(header.entries, header.crcs, found, strict=True):
            if got != crc:
                raise CheckpointCorruptError(
                    f"{path}: checksum mismatch in tensor {entry.name} "
                    f"({entry.end - entry.begin} bytes at offset {data_start + entry.begin})"
                )
    tensors = [_tensor_at(mapping, data_start, entry) for entry in header.entries]
    try:
        state = unflatten(json.loads(header.skeleton_json), tensors)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path}: bad skeleton: {e}") from None
    return state, part_info(path, size, header, verified=verify)


def open_for_read(path: Path) -> tuple[int, int, Header]:
    """The part's open file descriptor (the caller closes it), size and validated header."""
    fd = _open_for_reading(path)
    try:
        size = os.fstat(fd).st_size
        return fd, size, _read_header(fd, size, path)
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise _unreadable(path, e) from e
        raise


def read_info(path: _PathLike) -> PartInfo:
    """The part's header, validated (header checksum, sizes); tensor bytes are not read."""
    fd, size, header = open_for_read(Path(path))
    os.close(fd)
    return part_info(Path(path), size, header, verified=False)


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
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # must not outlive the mapping
    try:
        for entry, tensor in zip(layout.entries, tensors, strict=True):
            if entry.end > entry.begin:
                span = whole[layout.data_start + entry.begin : layout.data_start + entry.end]
                dst = span.view(entry.dtype).view(entry.shape)
                if pinned and tensor.is_cuda:
                    _copy_into(dst, tensor, non_blocking=True)
                else:
                    _copy_into(dst, tensor)
    finally:
        if pinned:  # also on errors: no DMA may still land in a mapping being dropped
            pinning.synchronize(devices)


def _checksums(mapping: mmap.mmap, data_start: int, entries: Sequence[Entry]) -> list[int]:
    """Each entry's CRC-32C, on every core (the hash releases the GIL on a large buffer): a
    restore reads the bytes once to verify them, then the trainer copies them into its model."""
    with memoryview(mapping) as view:
        spans = [view[data_start + e.begin : data_start + e.end] for e in entries]
        try:
            if len(spans) < 2 or sum(len(s) for s in spans) < _PARALLEL_CRC_BYTES:
                return [checksum(span) for span in spans]
            with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="ftrun-crc") as pool:
                return list(pool.map(checksum, spans))
        finally:
            for span in spans:
                span.release()


def _tensor_at(mapping: mmap.mmap, data_start: int, entry: Entry) -> torch.Tensor:
    if entry.end == entry.begin:
        return torch.empty(entry.shape, dtype=entry.dtype)
    count = math.prod(entry.shape)
    flat = torch.frombuffer(
        mapping, dtype=entry.dtype, count=count, offset=data_start + entry.begin
    )
    return flat.view(entry.shape)


def _read_header(fd: int, size: int, path: Path) -> Header:
    prefix = os.pread(fd, PREFIX_BYTES, 0)
    if len(prefix) < PREFIX_BYTES:
        raise CheckpointCorruptError(f"{path}: truncated ({size} bytes, no header length)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(
            f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )
    if PREFIX_BYTES + header_len > size:
        raise CheckpointCorruptError(
            f"{path}: truncated ({size} bytes, the header alone is {header_len})"
        )
    raw = os.pread(fd, header_len, PREFIX_BYTES)
    try:
        return decode_header(raw, size - PREFIX_BYTES - header_len)
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}: {e}") from None


def part_info(path: Path, size: int, header: Header, verified: bool) -> PartInfo:
    return PartInfo(
        path=str(path),
        iteration=header.iteration,
        nbytes=size,
        tensor_count=len(header.entries),
        tensor_bytes=size - PREFIX_BYTES - header.header_len,
        checksums_verified=verified,
        metadata=header.user_metadata,
    )


def _open_for_reading(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint part") from None
    except OSError as e:
        raise _unreadable(path, e) from e


def _reserve(fd: int, size: int) -> None:
    """Give the file `size` bytes of real blocks (see the module docstring for why)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot: fall back
            raise
        os.ftruncate(fd, size)


def _is_volatile(path: Path) -> bool:
    resolved = os.path.realpath(path.parent) + "/"
    return resolved.startswith(_VOLATILE_ROOTS)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(path: Path, error: OSError) -> CheckpointWriteError:
    return CheckpointWriteError(f"cannot write checkpoint part {path}: {error.strerror or error}")


def _unreadable(path: Path, error: OSError) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: unreadable: {error.strerror or error}")
