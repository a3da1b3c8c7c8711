"""Rank reassignment and activation between restart iterations (NVRx's
`inprocess.rank_assignment`).

Every surviving rank runs the same assignment with the same inputs (its own `State`, the set of
terminated ranks, the iteration's store) and so reaches the same new numbering without a leader.
An assignment that needs the other ranks' data (`FilterCountGroupedByKey`, the first call of
`Tree`) gathers it through `ctx.store`, which the wrapper scopes to the current iteration: each
live rank sets `ra/key/<n>/<rank>` (its n-th gather), then waits for every live rank's key.

A rank that the assignment removes gets `RankDiscarded`; the others return the updated `ctx`.
Assignments that renumber (`ShiftRanks`, `FillGaps`) go before (run after, in a `Compose`)
those that mark ranks terminated (`FilterCountGroupedByKey`); filters (`RankFilter`) come last.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections import Counter
from collections.abc import Callable

from ftrun.inprocess.assignment_base import (
    KeyOrFn,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    encode_key,
    gather_keys,
    surviving_rank,
)
from ftrun.inprocess.state import Mode, State
from ftrun.inprocess.tree import Layer, LayerFlag, Tree

log = logging.getLogger("ftrun.inprocess")

__all__ = [
    "ActivateAllRanks", "ActiveWorldSizeDivisibleBy", "FillGaps", "FilterCountGroupedByKey",
    "KeyOrFn", "Layer", "LayerFlag", "MaxActiveWorldSize", "RankAssignment",
    "RankAssignmentCtx", "RankDiscarded", "RankFilter", "ShiftRanks", "Tree", "gather_keys",
]  # fmt: skip


class RankFilter(RankAssignment):
    """A `RankAssignment` that only marks ranks active or inactive, keeping rank numbers; put
    filters after (outermost in a `Compose`) the assignments that renumber."""


class ActivateAllRanks(RankFilter):
    """Every rank is active with `active_rank = rank`; not to be combined with other filters."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        ctx.state = dataclasses.replace(state, mode=Mode.ACTIVE, active_rank=state.rank,
                                        active_world_size=state.world_size)  # fmt: skip
        return ctx


class MaxActiveWorldSize(RankFilter):
    """At most `max_active_world_size` ranks (None: no limit) are active: the lowest ones."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        ctx.state = _activate_lowest(ctx.state, size, f"max active world size {size}")
        return ctx


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The active world size is rounded down to a multiple of `divisor`; the lowest ranks are
    active."""

    def __init__(self, divisor: int = 1) -> None:
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_size(ctx.state) // self.divisor * self.divisor
        why = f"active world size divisible by {self.divisor}"
        ctx.state = _activate_lowest(ctx.state, size, why)
        return ctx


class ShiftRanks(RankAssignment):
    """Terminated ranks leave; each survivor moves down by the number of terminated ranks below
    it (order kept): 0 X 2 3 X X 6 7 -> 0 2 3 6 7."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, terminated = ctx.state, ctx.terminated_ranks
        rank = surviving_rank(state, terminated)
        new_rank = rank - sum(1 for dead in terminated if dead < rank)
        _log_move(rank, new_rank, "shifted")
        ctx.state = dataclasses.replace(state, rank=new_rank,
                                        world_size=state.world_size - len(terminated))  # fmt: skip
        ctx.terminated_ranks = set()
        return ctx


class FillGaps(RankAssignment):
    """Terminated ranks leave; the highest survivors take their places, the rest keep theirs:
    0 X 2 3 X X 6 7 -> 0 6 2 3 7.

    ftrun: as that picture; NVRx's formula sends 6 to 4 and 7 to 5 (past the new world size)
    whenever a terminated rank lies above the new world size.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, terminated = ctx.state, ctx.terminated_ranks
        rank = surviving_rank(state, terminated)
        world_size = state.world_size - len(terminated)
        new_rank = rank
        if rank >= world_size:
            # The k-th survivor past the new world size fills the k-th lowest gap.
            above = [r for r in range(world_size, state.world_size) if r not in terminated]
            gaps = sorted(r for r in terminated if r < world_size)
            new_rank = gaps[above.index(rank)]
        _log_move(rank, new_rank, "moved to fill a gap")
        ctx.state = dataclasses.replace(state, rank=new_rank, world_size=world_size)
        ctx.terminated_ranks = set()
        return ctx


class FilterCountGroupedByKey(RankAssignment):
    """Groups the live ranks by `key_or_fn` (a key, or a function of the rank's `State`) and
    marks every rank of a group terminated where `condition(group's live count)` is False; an
    assignment composed after it (e.g. `ShiftRanks`) removes them. Gathers the keys through
    the store, waiting at most `timeout`.

    ftrun: one gather (every rank sees every key) instead of NVRx's counters and two barriers.
    """

    def __init__(
        self, key_or_fn: KeyOrFn, condition: Callable[[int], bool],
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ) -> None:  # fmt: skip
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, terminated = ctx.state, ctx.terminated_ranks
        if state.rank in terminated:
            return ctx  # a terminated rank publishes nothing; the others do not wait for it
        keys = gather_keys(ctx, encode_key(self.key_or_fn, state), self.timeout)
        counts = Counter(keys.values())
        failed = {rank for rank, key in keys.items() if not self.condition(counts[key])}
        if state.rank in failed:
            log.info(
                "[In-process] rank %s marked for termination: group %s has %d live rank(s)",
                state.rank, keys[state.rank], counts[keys[state.rank]],
            )  # fmt: skip
        ctx.terminated_ranks = terminated | failed
        return ctx


def _current_active_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _activate_lowest(state: State, size: int, why: str) -> State:
    """Ranks below `size` active (keeping their numbers), the others inactive."""
    assert state.rank is not None
    if state.rank < size:
        return dataclasses.replace(state, mode=Mode.ACTIVE, active_rank=state.rank,
                                   active_world_size=size)  # fmt: skip
    if state.mode == Mode.ACTIVE:
        log.info("[In-process] rank %d deactivated: %s", state.rank, why)
    return dataclasses.replace(state, mode=Mode.INACTIVE, active_rank=None, active_world_size=size)


def _log_move(old: int, new: int, how: str) -> None:
    if old != new:
        log.info("[In-process] rank %d %s: now rank %d", old, how, new)
