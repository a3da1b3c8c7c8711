"""Reading a part into tensors that exist (the model's), checked as the bytes land.

`read_part` maps the file and returns views of it: a restore then reads the bytes twice (the
CRC check, then the trainer's copy into its model), and every page must first be mapped into the
new process (on a 2-core VM, mapping and checking 1 GiB cost as much as the copy itself).
`read_part_into(path, target)` reads each tensor with `preadv` straight into the matching tensor
of `target` (a state of the same structure, e.g. `{"model": model.state_dict(), ...}`, whose
tensors share memory with the model), in 1 MiB chunks, and computes each chunk's CRC-32C while
it is still in the CPU cache: one pass over the bytes, like `torch.distributed.checkpoint.load`
loading in place.

Matching is by path in the state, not by order: `target["model"]["w"]` receives the saved
`["model"]["w"]`. Values the checkpoint holds that `target` lacks (or holds as a non-tensor) are
read into new tensors; a tensor of another dtype or shape is a `CheckpointUsageError`; non-tensor
values (ints, strings...) come from the checkpoint. Tensors that are not contiguous CPU tensors
(CUDA ones) are read into a CPU buffer and copied.

On a checksum mismatch the target has been partly overwritten: the caller loads another copy
into it (the manager does) or must not use it. The returned state is the checkpoint's structure
with `target`'s tensors in it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import torch

from ftrun import untrusted_json
from ftrun.checkpointing.errors import CheckpointCorruptError, CheckpointUsageError
from ftrun.checkpointing.flatten import (
    TAG_DICT,
    TAG_KEYED_DICT,
    TAG_TENSOR,
    TAG_TUPLE,
    unflatten,
)
from ftrun.checkpointing.format import CRC_THREADS, PartInfo, open_for_read, part_info
from ftrun.checkpointing.layout import PREFIX_BYTES, Entry, Header

CHUNK_BYTES = 1 << 20  # fits the L2 cache: the CRC reads what `preadv` just wrote
_PARALLEL_BYTES = 64 << 20


def read_part_into(path: str | Path, target: Any) -> tuple[Any, PartInfo]:
    """Read the part at `path` into `target`'s tensors (see the module docstring).

    Raises `CheckpointNotFoundError`, `CheckpointCorruptError` (checksum, truncation, header)
    or `CheckpointUsageError` (a target tensor of another dtype or shape)."""
    path = Path(path)
    fd, size, header = open_for_read(path)
    try:
        skeleton = _skeleton(header, path)
        tensors = _destinations(skeleton, target, header.entries, path)
        data_start = PREFIX_BYTES + header.header_len
        jobs = list(zip(header.entries, header.crcs, tensors, strict=True))
        total = sum(e.end - e.begin for e in header.entries)
        if total < _PARALLEL_BYTES or CRC_THREADS == 1 or len(jobs) < 2:
            found = [_fill(fd, data_start, entry, dst) for entry, _, dst in jobs]
        else:
            with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="ftrun-read") as pool:
                found = list(pool.map(lambda job: _fill(fd, data_start, job[0], job[2]), jobs))
    finally:
        os.close(fd)
    for (entry, crc, _), got in zip(jobs, found, strict=True):
        if got != crc:
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in tensor {entry.name} "
                f"({entry.end - entry.begin} bytes at offset {data_start + entry.begin})"
            )
    try:
        state = unflatten(skeleton, tensors)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path}: bad skeleton: {e}") from None
    return state, part_info(path, size, header, verified=True)


def _skeleton(header: Header, path: Path) -> Any:
    try:
        return untrusted_json.loads(header.skeleton_json)
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}: bad skeleton: {e}") from None


def _destinations(
    skeleton: Any, target: Any, entries: Sequence[Entry], path: Path
) -> list[torch.Tensor]:
    """For each saved tensor, the target's tensor at the same path, or a new one."""
    found: dict[int, torch.Tensor] = {}
    _match(skeleton, target, found)
    out = []
    for index, entry in enumerate(entries):
        dst = found.get(index)
        if dst is None:
            out.append(torch.empty(entry.shape, dtype=entry.dtype))
            continue
        if dst.dtype != entry.dtype or tuple(dst.shape) != entry.shape:
            raise CheckpointUsageError(
                f"{path}: tensor {entry.name} is {entry.dtype} {list(entry.shape)}; "
                f"the target's is {dst.dtype} {list(dst.shape)}"
            )
        out.append(dst)
    return out


def _match(node: Any, target: Any, found: dict[int, torch.Tensor]) -> None:
    """Walk the saved skeleton and `target` together, collecting target tensors by index."""
    if type(node) is list:
        node = {TAG_TUPLE: node}  # lists and tuples index alike
    if type(node) is not dict or len(node) != 1:
        return
    ((tag, body),) = node.items()
    if tag == TAG_TENSOR and isinstance(target, torch.Tensor) and type(body) is int:
        found.setdefault(body, target)  # tied weights: one tensor, saved once
    elif tag == TAG_DICT and type(body) is dict and isinstance(target, dict):
        for key, child in body.items():
            if key in target:
                _match(child, target[key], found)
    elif tag == TAG_KEYED_DICT and type(body) is list and isinstance(target, dict):
        for pair in body:
            keyed = type(pair) is list and len(pair) == 2 and type(pair[0]) in (str, int)
            if keyed and pair[0] in target:
                _match(pair[1], target[pair[0]], found)
    elif tag == TAG_TUPLE and type(body) is list and isinstance(target, list | tuple):
        for i, child in enumerate(body[: len(target)]):
            _match(child, target[i], found)


def _fill(fd: int, data_start: int, entry: Entry, dst: torch.Tensor) -> int:
    """Read one tensor's bytes into `dst`; their CRC-32C."""
    nbytes = entry.end - entry.begin
    if nbytes == 0:
        return crc32c.crc32c(b"")
    direct = dst.device.type == "cpu" and dst.is_contiguous()
    buffer = dst if direct else torch.empty(entry.shape, dtype=entry.dtype)
    view = memoryview(buffer.detach().reshape(-1).view(torch.uint8).numpy())
    crc, offset = 0, 0
    while offset < nbytes:
        chunk = view[offset : offset + min(CHUNK_BYTES, nbytes - offset)]
        got = os.preadv(fd, [chunk], data_start + entry.begin + offset)
        if got != len(chunk):
            raise CheckpointCorruptError(f"tensor {entry.name}: the file ended early")
        crc = crc32c.crc32c(chunk, crc)
        offset += len(chunk)
    if not direct:
        dst.copy_(buffer)
    return crc
