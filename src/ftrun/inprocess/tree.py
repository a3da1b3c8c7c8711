"""`Tree`: rank assignment over the job's topology (NVRx's `rank_assignment.Tree`, `Layer`,
`LayerFlag`), beside the flat assignments in `rank_assignment`, which re-exports it; both build on
`assignment_base`.

Ranks are the leaves of a tree whose levels (`Layer`s) group them by a key (a node, a rack); a
group whose live ranks fall below its `min_ranks` is terminated whole, `max_ranks` caps a
group's active ranks (the rest are reserve), and a `RESERVE` or `BACKFILL` group supplies the
replacement for a terminated active rank.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
from collections.abc import Callable, Iterator

from ftrun.inprocess.assignment_base import (
    KeyOrFn,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    encode_key,
    gather_keys,
    log,
    surviving_rank,
)
from ftrun.inprocess.state import Mode


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

    def __init__(self, layers: list[Layer],
                 world_size_filter: Callable[[int], int] | None = None) -> None:  # fmt: skip
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
            surviving_rank(state, terminated)  # a rank terminated already never joins
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
        keys = [encode_key(layer.key_or_fn, ctx.state) for layer in self.layers]
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
            gaps.append(_active(donor or hole))  # the donor's old active rank, or the hole's
            if donor is not None:
                donor.active_rank = hole.active_rank
    return gaps


def _active(leaf: _Leaf) -> int:
    assert leaf.active_rank is not None
    return leaf.active_rank
