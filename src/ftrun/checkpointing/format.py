"""Checkpoint parts (one rank's state at one iteration, one file, no pickle): what a part
holds, and reading one back.

The bytes are laid out as `layout` describes (safetensors' layout); the state's structure is the
JSON skeleton of `flatten`. Reading never uses pickle, `torch.load` or `eval`. Parts are written
by `part_write`, atomically: into `<path>.tmp-<pid>` (`TMP_MARK`), renamed to `path` once whole.
The writer computes each tensor's CRC-32C and the reader checks it, both with `checksums`.

Reading, `read_part`, maps the file copy-on-write (`mmap.ACCESS_COPY`) and builds the tensors
on the mapping with `torch.frombuffer`: zero-copy. The pages are shared with the page cache
(on /dev/shm: with the file itself) until a tensor is written to; a write copies just that page
into private memory and never reaches the file. The tensors keep the mapping alive (and with it
the file's memory, even once the file is removed): drop the loaded state once it has been copied
into the model and optimizer. Files are only ever replaced by rename, never rewritten in place,
so a mapping never sees its bytes change under it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftrun.checkpointing.errors import CheckpointCorruptError, CheckpointNotFoundError
from ftrun.checkpointing.flatten import unflatten
from ftrun.checkpointing.layout import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    Entry,
    Header,
    checksum,
    decode_header,
)

TMP_MARK = ".tmp-"
"""A part being written is `<path>.tmp-<pid>` until it is renamed to `path`."""
_PARALLEL_CRC_BYTES = 64 * 2**20
CRC_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))
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
        found = checksums(mapping, data_start, header.entries)
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


def checksums(mapping: mmap.mmap, data_start: int, entries: Sequence[Entry]) -> list[int]:
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
    count, offset = math.prod(entry.shape), data_start + entry.begin
    flat = torch.frombuffer(mapping, dtype=entry.dtype, count=count, offset=offset)
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
    return PartInfo(path=str(path), iteration=header.iteration, nbytes=size,
                    tensor_count=len(header.entries),
                    tensor_bytes=size - PREFIX_BYTES - header.header_len,
                    checksums_verified=verified, metadata=header.user_metadata)  # fmt: skip


def _open_for_reading(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint part") from None
    except OSError as e:
        raise _unreadable(path, e) from e


def _unreadable(path: Path, error: OSError) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: unreadable: {error.strerror or error}")
