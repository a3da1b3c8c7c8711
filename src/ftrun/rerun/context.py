"""Where this rank runs and what every rank agrees on: the re-run state machine's view of its
process (rank, node, device), the all-reduce of its flags, and how results are compared and
shown. No state of its own."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Sequence
from typing import Any

from ftrun.environment import Env
from ftrun.rerun.data import RerunDataIterator

DataIteratorArg = RerunDataIterator | Sequence[RerunDataIterator] | None


def compare_floats(a: Any, b: Any) -> float:
    """Relative difference of two scalars (0-dim tensors or numbers); inf when one is NaN."""
    x, y = float(a), float(b)
    if math.isnan(x) or math.isnan(y):
        return 0.0 if math.isnan(x) and math.isnan(y) else math.inf
    if x == y:
        return 0.0
    return abs(x - y) / max(abs(x), abs(y))


def iterators(arg: DataIteratorArg) -> list[RerunDataIterator]:
    if arg is None:
        return []
    items = [arg] if isinstance(arg, RerunDataIterator) else list(arg)
    for item in items:
        if not isinstance(item, RerunDataIterator):
            raise TypeError("data iterators must be wrapped in RerunDataIterator")
    return items


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any rank (one all-reduce; alone: the flag)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    import torch

    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value)
    return bool(value.item() > 0)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def node() -> str:
    return os.environ.get(Env.NODE) or socket.gethostname()


def device() -> int:
    local = os.environ.get("LOCAL_RANK")
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:  # a CPU job has no device: the local rank stands in
        pass
    return int(local) if local is not None else -1


def plain(result: Any) -> Any:
    """A result as a number when it is a scalar (storable, comparable after a reload)."""
    try:
        return float(result)
    except (TypeError, ValueError, RuntimeError):
        return result


def text(result: Any) -> str:
    value = plain(result)
    return repr(value) if isinstance(value, float) else type(value).__name__
