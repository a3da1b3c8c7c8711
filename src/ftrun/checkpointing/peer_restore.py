"""A replicated state restored from the rank that holds the newest step, by broadcast.

Where every rank holds the same state (DDP's model and optimizer), a rank that lacks the newest
snapshot (a replaced rank's new process on a node that lost its memory, a spare without the
replica) need not send every rank back to an older step, or to the global tier: the lowest rank
holding the newest step reads it and broadcasts it over the job's process group (NCCL: GPU to
GPU). Nothing is pickled: the source sends the state's JSON skeleton and its tensors' shapes,
each receiver checks them against its own state (which must have the same structure: an
optimizer without state yet is given it first), and the tensors go one broadcast each.

Per-rank values in the state (a data loader's position, RNG states) are the source's after such
a restore: pass only what is replicated, or restore the rest apart.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ftrun.checkpointing.async_progress import agree_min, collective_device
from ftrun.checkpointing.collective import all_true, min_max, rank_and_world_size
from ftrun.checkpointing.errors import CheckpointError, CheckpointUsageError
from ftrun.checkpointing.flatten import Flat, flatten, unflatten
from ftrun.checkpointing.manager import LocalCheckpointManager


def restore_from_peer(
    manager: LocalCheckpointManager, live: dict[str, Any], prepare: Callable[[], dict[str, Any]]
) -> tuple[Any, int] | None:
    """(the state as of the newest step any rank holds, loaded into the live state's tensors,
    that step), or None when every rank holds the newest step (the usual load is then the
    fastest) or none holds any. A receiving rank's live state is `prepare()`'s (its optimizers
    given state first). Collective: every rank calls it."""
    rank, world = rank_and_world_size()
    mine = manager.newest_own()
    low, high = min_max(mine)
    if low == high or high < 0:
        return None
    source = agree_min([rank if mine == high else world])[0]
    loaded = None
    if rank == source:
        with contextlib.suppress(CheckpointError):  # a bad part: the usual rule goes older
            loaded = manager.read_own(high, live)
    if not all_true(rank != source or loaded is not None):
        return None
    device = collective_device()
    source_flat = flatten(loaded) if rank == source else None
    header = _broadcast_header(source_flat, source, device)
    tensors = source_flat.tensors if source_flat is not None else flatten(prepare()).tensors
    mismatch = _mismatch(header, tensors)
    if not all_true(mismatch is None):
        where = mismatch or "on another rank"
        raise CheckpointUsageError(
            f"rank {rank}: the state differs across ranks ({where}): it cannot come from a "
            "peer; restore without replicated=True"
        )
    for tensor in tensors:
        _broadcast_tensor(tensor, source, device)
    if device.type == "cpu":
        # gloo's worker threads drop a finished broadcast's tensors after `wait()` returned; a
        # tensor Python let go of first needs the GIL then, and at interpreter exit that
        # aborts the process ("terminate called without an active exception"). Waiting here
        # lets them finish while the state is still held.
        dist.barrier()
    return (loaded if rank == source else unflatten(header["skeleton"], tensors)), high


def _broadcast_header(flat: Flat | None, source: int, device: torch.device) -> dict[str, Any]:
    """The source's skeleton and tensor signatures (`flat`: the source's state taken apart,
    None elsewhere), as JSON bytes: a length, then the bytes."""
    data = b""
    if flat is not None:
        signature = [[list(t.shape), str(t.dtype)] for t in flat.tensors]
        data = json.dumps({"skeleton": flat.skeleton, "tensors": signature}).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, source)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if flat is not None:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, source)
    return json.loads(bytes(buffer.cpu().tolist()))


def _mismatch(header: dict[str, Any], tensors: tuple[torch.Tensor, ...]) -> str | None:
    theirs = header["tensors"]
    if len(theirs) != len(tensors):
        return f"{len(theirs)} tensors on the source, {len(tensors)} here"
    for index, ((shape, dtype), tensor) in enumerate(zip(theirs, tensors, strict=True)):
        if shape != list(tensor.shape) or dtype != str(tensor.dtype):
            return f"tensor {index}: {shape} {dtype} on the source, {list(tensor.shape)} here"
    return None


def _broadcast_tensor(tensor: torch.Tensor, source: int, device: torch.device) -> None:
    """In place; through a contiguous copy on the collectives' `device` where the tensor lives
    elsewhere (AdamW's step counters on the CPU under NCCL)."""
    if tensor.is_contiguous() and tensor.device.type == device.type:
        dist.broadcast(tensor, source)
        return
    staged = tensor.to(device)
    dist.broadcast(staged, source)
    tensor.copy_(staged)
