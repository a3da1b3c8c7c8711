"""What the nodes hold and what the job restores: the keeper's decisions, as pure functions.

Nothing here touches a file, the store or the network; `restore` and `replicator` apply what
these functions decide. Ranks are global ranks; nodes are group ranks of the round, whose
global ranks are `node_ranges(local world sizes)`.

The restore choice, per session (`choose`): the newest iteration that is *complete*, i.e. for
one world size W every rank 0..W-1 has a part of it on some node. If complete sets exist for
several world sizes, the newest iteration wins whatever its world size; on a tie (the same
iteration complete at two world sizes) the round's world size wins, then the larger. If the
winner's world size is not the round's, nothing is restored (-1): a part is one rank's shard,
and resharding is not the keeper's job. Parts above the restored iteration, and parts of other
world sizes, belong to a timeline the job left: `after_restore` removes them, so that they can
never mix with the parts that the resumed run writes under the same iteration numbers.

The agreement (`first_decision`, `next_decision`): one node decides from every node's holdings;
a decision that needs no fetch is final at once. Otherwise each node fetches its ranks' missing
parts and reports an `Outcome`; a session any node could not complete falls back to an older
complete iteration without the holders that failed, at most `attempts` times, then to -1. A node
that reports nothing, or gives up, makes the whole job restore nothing: every rank then starts
from the same place.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ftrun.checkpointing.replication import CliqueReplicationStrategy
from ftrun.checkpointing.store import PartKey

Holdings = Mapping[str, Mapping[PartKey, int]]
"""One node's complete parts: session -> part -> size in bytes."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """The iteration one session restores (-1: none) and the world size it was saved at."""

    iteration: int
    world_size: int
    note: str = ""
    """Why, in words, for the log (empty when a complete iteration was found)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step of the agreement: what every node restores (final) or fetches (not final)."""

    attempt: int
    final: bool
    choices: Mapping[str, Choice]
    sources: tuple[int, ...] = ()
    """The nodes (group ranks) whose holdings it was decided from."""
    excluded: frozenset[int] = frozenset()
    """Holders that failed to deliver: not asked again."""
    aborted: str | None = None
    """Set when a node gave up: every session restores nothing."""

    def choice(self, session: str, world_size: int) -> Choice:
        found = None if self.aborted else self.choices.get(session)
        return found or Choice(-1, world_size, self.aborted or "no node holds a part of it")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One node's report after an attempt's fetches."""

    failed: Mapping[str, frozenset[int]] = dataclasses.field(default_factory=dict)
    """Sessions whose parts this node could not get, with the holders that did not deliver."""
    aborted: str | None = None
    """This node cannot take part (its keeper failed): the job restores nothing."""


def node_ranges(local_world_sizes: Sequence[int]) -> list[range]:
    """Each node's global ranks, in group-rank order."""
    starts = list(itertools.accumulate(local_world_sizes, initial=0))
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def node_of_rank(rank: int, ranges: Sequence[range]) -> int:
    """The group rank of the node hosting global `rank`."""
    index = bisect.bisect_right([r.start for r in ranges], rank) - 1
    if index < 0 or rank not in ranges[index]:
        raise ValueError(f"rank {rank} is not in this round's {ranges[-1].stop} ranks")
    return index


def push_targets(
    rank: int, world_size: int, jump: int, factor: int, ranges: Sequence[range], me: int
) -> list[int]:
    """The nodes (group ranks, ascending, never `me`) that host the other ranks of `rank`'s
    clique: where a new part of `rank` is copied. Raises `CheckpointUsageError` when the
    world size does not split into cliques."""
    clique = CliqueReplicationStrategy(jump, factor).clique_of(rank, world_size)
    return sorted({node_of_rank(r, ranges) for r in clique} - {me})


def parts_by_node(
    holdings: Mapping[int, Holdings], session: str, excluded: Iterable[int] = ()
) -> dict[int, frozenset[PartKey]]:
    """Each node's complete parts of `session`, without the `excluded` nodes."""
    skip = set(excluded)
    return {n: frozenset(held.get(session, {})) for n, held in holdings.items() if n not in skip}


def choose(
    parts: Mapping[int, Iterable[PartKey]], world_size: int, below: int | None = None
) -> Choice:
    """The newest complete iteration (below `below` if given); see the module docstring."""
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    for keys in parts.values():
        for key in keys:
            if below is None or key.iteration < below:
                ranks[key.iteration, key.world_size].add(key.rank)
    complete = [
        (iteration, size)
        for (iteration, size), held in ranks.items()
        if len(held) == size and all(0 <= r < size for r in held)
    ]
    if not complete:
        return Choice(-1, world_size, "no iteration is complete for every rank")
    iteration, size = max(complete, key=lambda c: (c[0], c[1] == world_size, c[1]))
    if size != world_size:
        why = f"the newest complete iteration, {iteration}, was saved by {size} ranks"
        return Choice(-1, world_size, f"{why} and this round has {world_size}: not restoring")
    return Choice(iteration, world_size)


def fetch_plan(
    choice: Choice,
    parts: Mapping[int, frozenset[PartKey]],
    me: int,
    my_ranks: range,
    held: Iterable[PartKey],
) -> list[tuple[PartKey, tuple[int, ...]]]:
    """The parts of the chosen iteration that node `me` lacks for its ranks, each with the
    nodes that hold it (rotated by rank, to spread the load; empty: nobody has it)."""
    if choice.iteration < 0:
        return []
    have = set(held)
    plan = []
    for rank in my_ranks:
        key = PartKey(choice.iteration, rank, choice.world_size)
        if key in have:
            continue
        holders = sorted(node for node, keys in parts.items() if key in keys and node != me)
        shift = rank % len(holders) if holders else 0
        plan.append((key, tuple(holders[shift:] + holders[:shift])))
    return plan


def _needs_fetch(
    choices: Mapping[str, Choice], holdings: Mapping[int, Holdings], ranges: Sequence[range]
) -> bool:
    for session, choice in choices.items():
        parts = parts_by_node(holdings, session)
        for node, ranks in enumerate(ranges):
            held = parts.get(node, frozenset())
            if fetch_plan(choice, parts, node, ranks, held):
                return True
    return False


def first_decision(holdings: Mapping[int, Holdings], ranges: Sequence[range]) -> Decision:
    """Attempt 0: each session's newest complete iteration; final if no node must fetch."""
    world_size = ranges[-1].stop
    sessions = sorted({s for held in holdings.values() for s in held})
    choices = {s: choose(parts_by_node(holdings, s), world_size) for s in sessions}
    final = not _needs_fetch(choices, holdings, ranges)
    return Decision(0, final, choices, tuple(sorted(holdings)))


def next_decision(
    prev: Decision,
    holdings: Mapping[int, Holdings],
    outcomes: Mapping[int, Outcome | None],
    ranges: Sequence[range],
    attempts: int,
) -> Decision:
    """After attempt `prev.attempt`'s fetches: final if every node got its parts; else the
    failed sessions fall back (see the module docstring)."""
    attempt = prev.attempt + 1
    silent = [node for node in range(len(ranges)) if outcomes.get(node) is None]
    gave_up = {n: o.aborted for n, o in outcomes.items() if o is not None and o.aborted}
    if silent or gave_up:
        why = f"node(s) {silent} did not report" if silent else f"node(s) gave up: {gave_up}"
        return dataclasses.replace(prev, attempt=attempt, final=True, aborted=why)
    failed: dict[str, set[int]] = defaultdict(set)
    for outcome in outcomes.values():
        assert outcome is not None
        for session, holders in outcome.failed.items():
            failed[session] |= holders
    if not failed:
        return dataclasses.replace(prev, attempt=attempt, final=True)
    excluded = prev.excluded.union(*failed.values())
    world_size = ranges[-1].stop
    choices = dict(prev.choices)
    for session in failed:
        below = prev.choice(session, world_size).iteration
        if attempt >= attempts:
            choices[session] = Choice(-1, world_size, f"no attempt of {attempts} got every part")
        else:
            choices[session] = choose(parts_by_node(holdings, session, excluded), world_size, below)
    final = all(choices[s].iteration < 0 for s in failed)
    return Decision(attempt, final, choices, prev.sources, frozenset(excluded))


def retention(
    keys: Iterable[PartKey], keep: int, protected: tuple[int, int] | None = None
) -> list[PartKey]:
    """The parts to remove so that each (rank, world size) keeps its `keep` newest, and its
    part of the `protected` (iteration, world size) whatever its age."""
    by_rank: dict[tuple[int, int], list[PartKey]] = defaultdict(list)
    for key in keys:
        by_rank[key.rank, key.world_size].append(key)
    doomed = [k for group in by_rank.values() for k in sorted(group)[: max(0, len(group) - keep)]]
    return [k for k in doomed if (k.iteration, k.world_size) != protected]


def held_ranks(
    world_size: int, jump: int | None, factor: int | None, ranges: Sequence[range], me: int
) -> frozenset[int]:
    """The ranks whose parts node `me` holds once replication caught up: its own, and with
    replication every rank of its ranks' cliques (a clique holds each of its members' parts).
    Raises `CheckpointUsageError` when the world size does not split into cliques."""
    own = frozenset(ranges[me])
    if factor is None or factor <= 1:
        return own
    strategy = CliqueReplicationStrategy(jump or 1, factor)
    return own.union(*(strategy.clique_of(rank, world_size) for rank in own))


def newest_held_whole(keys: Iterable[PartKey], held: Iterable[int], world_size: int) -> int:
    """The newest iteration at `world_size` of which `keys` has every rank in `held`; -1."""
    ranks: dict[int, set[int]] = defaultdict(set)
    for key in keys:
        if key.world_size == world_size:
            ranks[key.iteration].add(key.rank)
    wanted = set(held)
    return max((it for it, got in ranks.items() if wanted <= got), default=-1)


def after_restore(keys: Iterable[PartKey], choice: Choice, keep: int) -> list[PartKey]:
    """The parts to remove once the job restores `choice`: everything above it or of another
    world size (all of them when it restores nothing), then retention on the rest."""
    keys = list(keys)
    stays = [
        k for k in keys if k.world_size == choice.world_size and k.iteration <= choice.iteration
    ]
    doomed = set(retention(stays, keep))
    return sorted(k for k in keys if k not in stays or k in doomed)
