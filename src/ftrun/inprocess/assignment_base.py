"""What every rank assignment shares (NVRx's `inprocess.rank_assignment` base names): the
context an assignment reads and rewrites, its base class, the error of a removed rank, and the
store gather the assignments that need the other ranks' data go through. `rank_assignment`
(the flat assignments) and `tree` (`Tree`) both build on it; `rank_assignment` re-exports all.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import json
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ftrun.eventlog.failures import ranks_text
from ftrun.inprocess import exception
from ftrun.inprocess.state import State

log = logging.getLogger("ftrun.inprocess")

KeyOrFn = str | Callable[[State], Any]


class RankDiscarded(exception.RestartError):
    """This rank was removed by the rank assignment and takes no further part."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """What a rank assignment reads and rewrites: this rank's `state`, the iteration's `store`
    and the (current) ranks terminated so far."""

    state: State
    store: dist.Store
    terminated_ranks: set[int]


class RankAssignment(abc.ABC):
    """Computes the next iteration's ranks, world size and which ranks are active (call the
    function) or inactive (wait as reserves); compose several with `Compose`."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Return `ctx` with the new state; raise `RankDiscarded` on a rank that is removed."""
        raise NotImplementedError


def gather_keys(
    ctx: RankAssignmentCtx, value: str, timeout: datetime.timedelta | None = None
) -> dict[int, str]:
    """`{rank: value}` of every live rank (in `range(world_size)`, not terminated), this one's
    included; `timeout` None waits as long as the store's own timeout.

    The n-th gather of an iteration on one rank meets the n-th on every other (each rank counts
    its own gathers in the iteration's store), so the assignments need no agreed names.
    """
    store, state = ctx.store, ctx.state
    seq = store.add(f"ra/seq/{state.rank}", 1)
    store.set(f"ra/key/{seq}/{state.rank}", value)
    live = [r for r in range(state.world_size) if r not in ctx.terminated_ranks]
    names = [f"ra/key/{seq}/{r}" for r in live]
    if timeout is None:
        store.wait(names)
    else:
        store.wait(names, timeout)
    return {rank: store.get(key).decode() for rank, key in zip(live, names, strict=True)}


def surviving_rank(state: State, terminated: set[int]) -> int:
    """This rank's number, or RankDiscarded if it is among the terminated ones."""
    if state.rank is None or state.rank in terminated:
        gone = ranks_text(terminated)
        raise RankDiscarded(f"rank {state.rank} discarded (terminated ranks {gone})")
    return state.rank


def encode_key(key_or_fn: KeyOrFn, state: State) -> str:
    """The group key as text (JSON, so that 1 and "1" stay different keys)."""
    key = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    return json.dumps(key, default=repr, sort_keys=True)
