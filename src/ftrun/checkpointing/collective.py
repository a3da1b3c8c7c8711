"""Which rank this process is, and the one collective the local checkpoints agree through.

Under plain torchrun, when `torch.distributed` is initialized, `LocalCheckpointManager`'s
`find_latest` and `load` are collective (every rank must call them, as in NVRx): `min_max`
all-reduces (MIN) a CPU int64 tensor on the default group, a CUDA one if that group is
NCCL-only; gloo needs nothing else. Without `torch.distributed`, each function answers for
this process alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ftrun.checkpointing.errors import CheckpointUsageError


def rank_and_world_size() -> tuple[int, int]:
    """From torch.distributed when initialized, else torchrun's RANK/WORLD_SIZE, else 0 of 1."""
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise CheckpointUsageError(f"RANK={rank} is not in 0..WORLD_SIZE-1={world_size - 1}")
    return rank, world_size


def min_max(value: int) -> tuple[int, int]:
    """(min, max) of `value` over all ranks: one all-reduce MIN of (value, -value)."""
    if not _distributed():
        return value, value
    both = torch.tensor([value, -value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return int(both[0]), -int(both[1])


def all_true(flag: bool) -> bool:
    """Whether `flag` is true on every rank."""
    return min_max(int(flag))[0] == 1


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise CheckpointUsageError(f"{name}={text!r} is not an integer") from None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device() -> torch.device:
    """CPU, unless the default group only speaks NCCL (which cannot reduce CPU tensors)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
