"""Which rank this process is, and the one collective the local checkpoints agree through.

Under plain torchrun, when `torch.distributed` is initialized, `LocalCheckpointManager`'s
`find_latest` and `load` are collective (every rank must call them, as in NVRx): `min_max`
all-reduces (MIN) a CPU int64 tensor on the default group, a CUDA one if that group is
NCCL-only (`async_progress.agree_min`); gloo needs nothing else. Without `torch.distributed`,
each function answers for this process alone.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ftrun.checkpointing.async_progress import agree_min, distributed
from ftrun.checkpointing.errors import CheckpointUsageError


def rank_and_world_size() -> tuple[int, int]:
    """From torch.distributed when initialized, else torchrun's RANK/WORLD_SIZE, else 0 of 1."""
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise CheckpointUsageError(f"RANK={rank} is not in 0..WORLD_SIZE-1={world_size - 1}")
    return rank, world_size


def min_max(value: int) -> tuple[int, int]:
    """(min, max) of `value` over all ranks: one all-reduce MIN of (value, -value)."""
    low, neg_high = agree_min([value, -value])
    return low, -neg_high


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
