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

import abc
import dataclasses
import datetime
import enum
import itertools
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.distributed as dist

from ftrun.inprocess import exception
from ftrun.inprocess.state import Mode, State

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


class RankFilter(RankAssignment):
    """A `RankAssignment` that only marks ranks active or inactive, keeping rank numbers; put
    filters after (outermost in a `Compose`) the assignments that renumber."""


class ActivateAllRanks(RankFilter):
    """Every rank is active with `active_rank = rank`; not to be combined with other filters."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        ctx.state = dataclasses.replace(
            state, mode=Mode.ACTIVE, active_rank=state.rank, active_world_size=state.world_size
        )
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
        rank = _surviving_rank(state, terminated)
        new_rank = rank - sum(1 for dead in terminated if dead < rank)
        _log_move(rank, new_rank, "shifted")
        ctx.state = dataclasses.replace(
            state, rank=new_rank, world_size=state.world_size - len(terminated)
        )
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
        rank = _surviving_rank(state, terminated)
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
        self,
        key_or_fn: KeyOrFn,
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ) -> None:
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, terminated = ctx.state, ctx.terminated_ranks
        if state.rank in terminated:
            return ctx  # a terminated rank publishes nothing; the others do not wait for it
        keys = gather_keys(ctx, _encode_key(self.key_or_fn, state), self.timeout)
        counts = Counter(keys.values())
        failed = {rank for rank, key in keys.items() if not self.condition(counts[key])}
        if state.rank in failed:
            log.info(
                "[In-process] rank %s marked for termination: group %s has %d live rank(s)",
                state.rank, keys[state.rank], counts[keys[state.rank]],
            )  # fmt: skip
        ctx.terminated_ranks = terminated | failed
        return ctx


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


class LayerFlag(enum.Flag):
    """How a `Tree` layer's groups take part in replacing a terminated active rank.

    RESERVE: an inactive (reserve) rank in this group may replace it.
    BACKFILL: the group's highest active rank may take its number (like `FillGaps`).
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


@dataclasses.dataclass
class Layer:
    """One level of a `Tree`: ranks are grouped by `key_or_fn`; a group with fewer than
    `min_ranks` live ranks is terminated whole; at most `max_ranks` (None: any) of a group's
    ranks start active; `flag` lets the group supply replacements."""

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: KeyOrFn = ""
    flag: LayerFlag | None = None


class Tree(RankAssignment):
    """Rank assignment over a topology tree: `layers[0]` groups every rank (all ranks must share
    its key), each next layer splits its parent's groups by that layer's key, ranks are leaves.

    First call: the live ranks' keys are gathered through the store; in tree order, a rank
    starts active unless a group above it already has `max_ranks` active ranks. Every call,
    for the terminated ranks: (1) a group left with fewer than `min_ranks` live ranks is
    terminated whole, innermost first; (2) a terminated active rank is replaced by an inactive
    rank of the nearest enclosing `RESERVE` group (searching outwards through `RESERVE` groups
    only); (3) else, within its outermost enclosing run of `BACKFILL` groups, the highest active
    rank takes its active rank; (4) the remaining gaps close by shifting (as `ShiftRanks`);
    (5) `world_size_filter(n)` may lower the active world size, deactivating the ranks above
    it. Ranks are then renumbered contiguously in tree order. Not to be composed with other
    assignments. The topology is kept from the first call on.

    ftrun: the same algorithm in a compact form; where several reserves could replace a rank,
    the last in tree order is taken (NVRx: the last one deactivated).
    """

    def __init__(
        self, layers: list[Layer], world_size_filter: Callable[[int], int] | None = None
    ) -> None:
        if not layers:
            raise ValueError("Tree needs at least one Layer")
        self.layers = list(layers)
        self.world_size_filter = world_size_filter
        self._root: _Group | None = None
        self._leaves: list[_Leaf] = []  # tree order
        self._active_world_size = 0

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, terminated = ctx.state, set(ctx.terminated_ranks)
        if self._root is None:
            _surviving_rank(state, terminated)  # a rank terminated already never joins
            self._build(ctx)
            terminated = set()  # the terminated ranks are not in the tree at all
        by_rank = {leaf.rank: leaf for leaf in self._leaves if leaf.rank is not None}
        mine = next(leaf for leaf in self._leaves if leaf.initial_rank == state.initial_rank)
        before = (mine.mode, mine.active_rank)
        self._replace(self._propagate({by_rank[r] for r in terminated if r in by_rank}))
        if self.world_size_filter is not None:
            self._filter(self.world_size_filter)
        live = [leaf for leaf in self._leaves if leaf.mode != Mode.TERMINATED]
        for rank, leaf in enumerate(live):
            leaf.rank = rank
        if mine.mode == Mode.TERMINATED:
            raise RankDiscarded(f"initial rank {state.initial_rank} discarded by the tree")
        if (mine.mode, mine.active_rank) != before:
            log.info(
                "[In-process] initial rank %s: %s active rank %s -> %s active rank %s",
                mine.initial_rank, before[0].value, before[1], mine.mode.value, mine.active_rank,
            )  # fmt: skip
        ctx.state = dataclasses.replace(
            state, rank=mine.rank, world_size=len(live), mode=mine.mode,
            active_rank=mine.active_rank, active_world_size=self._active_world_size,
        )  # fmt: skip
        ctx.terminated_ranks = set()
        return ctx

    def _build(self, ctx: RankAssignmentCtx) -> None:
        """Gather every live rank's keys, build the groups and activate the first ranks."""
        keys = [_encode_key(layer.key_or_fn, ctx.state) for layer in self.layers]
        entry = json.dumps({"initial_rank": ctx.state.initial_rank, "keys": keys})
        gathered = gather_keys(ctx, entry)
        entries = {rank: json.loads(text) for rank, text in gathered.items()}
        roots = {entry["keys"][0] for entry in entries.values()}
        if len(roots) != 1:
            raise ValueError(f"Tree: the ranks' root-layer keys differ: {sorted(roots)}")
        root = _Group(self.layers[0])
        for rank in sorted(entries):
            path = [root]
            for key, layer in zip(entries[rank]["keys"][1:], self.layers[1:], strict=True):
                path.append(path[-1].children.setdefault(key, _Group(layer)))
            path[-1].own.append(_Leaf(entries[rank]["initial_rank"], rank, tuple(path)))
        self._root, self._leaves = root, list(root.walk())
        if [leaf.rank for leaf in self._leaves] != sorted(entries):
            log.warning("Tree: the ranks' order differs from the topology's; renumbering")
        for leaf in self._leaves:
            for group in leaf.parents:
                group.leaves.append(leaf)
            if all(g.layer.max_ranks is None or g.active < g.layer.max_ranks for g in leaf.parents):
                leaf.mode, leaf.active_rank = Mode.ACTIVE, self._active_world_size
                self._active_world_size += 1
                for group in leaf.parents:
                    group.active += 1

    def _propagate(self, dead: set[_Leaf]) -> set[_Leaf]:
        """`dead` plus the live ranks of every group left below its `min_ranks`."""
        assert self._root is not None
        for group in self._root.post_order():
            alive = [leaf for leaf in group.leaves if leaf.mode != Mode.TERMINATED]
            alive = [leaf for leaf in alive if leaf not in dead]
            if len(alive) < group.layer.min_ranks:
                dead.update(alive)
        return dead

    def _replace(self, dead: set[_Leaf]) -> None:
        """Terminate `dead`; fill their active ranks from reserves, then backfill, then shift."""
        holes = sorted((leaf for leaf in dead if leaf.mode == Mode.ACTIVE), key=_active)
        for leaf in dead:
            leaf.mode = Mode.TERMINATED
        unfilled = []
        for hole in holes:
            spare = _spare_for(hole)
            if spare is None:
                unfilled.append(hole)
            else:
                spare.mode, spare.active_rank = Mode.ACTIVE, hole.active_rank
        gaps = sorted(_backfill(unfilled))
        for leaf in dead:
            leaf.active_rank, leaf.rank = None, None
        for leaf in self._leaves:
            if leaf.active_rank is not None:
                leaf.active_rank -= sum(1 for gap in gaps if gap < leaf.active_rank)
        self._active_world_size -= len(gaps)

    def _filter(self, world_size_filter: Callable[[int], int]) -> None:
        size = world_size_filter(self._active_world_size)
        if size > self._active_world_size:
            raise ValueError(f"world_size_filter({self._active_world_size}) returned {size}")
        for leaf in self._leaves:
            if leaf.active_rank is not None and leaf.active_rank >= size:
                leaf.mode, leaf.active_rank = Mode.INACTIVE, None
        self._active_world_size = size


@dataclasses.dataclass(eq=False)
class _Leaf:
    initial_rank: int
    rank: int | None
    parents: tuple[_Group, ...]  # the root first
    mode: Mode = Mode.INACTIVE
    active_rank: int | None = None


@dataclasses.dataclass(eq=False)
class _Group:
    layer: Layer
    children: dict[str, _Group] = dataclasses.field(default_factory=dict)
    own: list[_Leaf] = dataclasses.field(default_factory=list)  # leaves directly here
    leaves: list[_Leaf] = dataclasses.field(default_factory=list)  # all below, tree order
    active: int = 0  # ranks activated by the first call

    def walk(self) -> Iterator[_Leaf]:
        """The leaves below, in tree order."""
        yield from self.own
        for child in self.children.values():
            yield from child.walk()

    def post_order(self) -> Iterator[_Group]:
        for child in self.children.values():
            yield from child.post_order()
        yield self


def _flagged(group: _Group, flag: LayerFlag) -> bool:
    return group.layer.flag is not None and bool(group.layer.flag & flag)


def _spare_for(hole: _Leaf) -> _Leaf | None:
    """An inactive rank of the nearest group around `hole`, through RESERVE groups only."""
    for group in reversed(hole.parents):
        if not _flagged(group, LayerFlag.RESERVE):
            return None
        spares = [leaf for leaf in group.leaves if leaf.mode == Mode.INACTIVE]
        if spares:
            return spares[-1]
    return None


def _backfill(holes: list[_Leaf]) -> list[int]:
    """Move the highest active ranks of each hole's BACKFILL domain into the holes; the active
    ranks left empty (a donor's old one, or a hole nobody could fill)."""
    gaps: list[int] = []
    domains: dict[int, tuple[_Group, list[_Leaf]]] = {}
    for hole in holes:
        domain = None
        for group in reversed(hole.parents):
            if not _flagged(group, LayerFlag.BACKFILL):
                break
            domain = group
        if domain is None:
            gaps.append(_active(hole))
        else:
            domains.setdefault(id(domain), (domain, []))[1].append(hole)
    for domain, domain_holes in domains.values():
        active = sorted((leaf for leaf in domain.leaves if leaf.mode == Mode.ACTIVE), key=_active)
        donors = active[-len(domain_holes) :]
        for donor, hole in itertools.zip_longest(donors, domain_holes):
            if hole is None:
                break
            if donor is None:
                gaps.append(_active(hole))
            else:
                gaps.append(_active(donor))
                donor.active_rank = hole.active_rank
    return gaps


def _active(leaf: _Leaf) -> int:
    assert leaf.active_rank is not None
    return leaf.active_rank


def _current_active_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _activate_lowest(state: State, size: int, why: str) -> State:
    """Ranks below `size` active (keeping their numbers), the others inactive."""
    assert state.rank is not None
    if state.rank < size:
        return dataclasses.replace(
            state, mode=Mode.ACTIVE, active_rank=state.rank, active_world_size=size
        )
    if state.mode == Mode.ACTIVE:
        log.info("[In-process] rank %d deactivated: %s", state.rank, why)
    return dataclasses.replace(state, mode=Mode.INACTIVE, active_rank=None, active_world_size=size)


def _surviving_rank(state: State, terminated: set[int]) -> int:
    """This rank's number, or RankDiscarded if it is among the terminated ones."""
    if state.rank is None or state.rank in terminated:
        raise RankDiscarded(f"rank {state.rank} discarded (terminated ranks {_ranks(terminated)})")
    return state.rank


def _log_move(old: int, new: int, how: str) -> None:
    if old != new:
        log.info("[In-process] rank %d %s: now rank %d", old, how, new)


def _encode_key(key_or_fn: KeyOrFn, state: State) -> str:
    """The group key as text (JSON, so that 1 and "1" stay different keys)."""
    key = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    return json.dumps(key, default=repr, sort_keys=True)


def _ranks(ranks: Iterable[int]) -> str:
    """A rank set in ranges for log lines: "{0-2, 5}"."""
    parts = []
    ordered = sorted(ranks)
    for _, run in itertools.groupby(enumerate(ordered), lambda pair: pair[1] - pair[0]):
        block = [rank for _, rank in run]
        parts.append(str(block[0]) if len(block) == 1 else f"{block[0]}-{block[-1]}")
    return "{" + ", ".join(parts) + "}"
