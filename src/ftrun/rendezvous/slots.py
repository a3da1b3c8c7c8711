"""Who takes which slot (group rank) of a barrier round, and who stands by (pure).

A round has up to `max_nodes` slots. Some slots have an *owner* that the round waits for:
- after a restart, the nodes of the previous round own the slots they had, so a crash restarts
  on the same nodes with the same group ranks, whatever order they arrive in;
- in the first round with `--ft-use-infra-group-rank`, infra rank `i` owns slot `i`: the active
  nodes are the lowest infra ranks, the others stand by.

An owner known to be gone (dead, unhealthy, excluded) gives up its slot at once; one that is
late gives it up once the last call is over. Slots without an owner go to the other arrivals
(hot spares) in arrival order, or infra-rank order when infra ranks are used, lowest slot first.
When too few nodes are there to fill every slot, the remaining ones keep their order and close
up (an elastic round of fewer nodes). Arrivals left over stand by for the next cycle.

An owner stepping aside (one of its ranks' steps is re-run elsewhere) is still waited for like
any owner, and then gives its slot to a spare: it arrives only once its stop is over, which
includes replicating the checkpoint its ranks saved for the re-run, and the round's restore
needs that checkpoint on the nodes that take part.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A node that arrived at the round and wrote its descriptor."""

    index: int
    """Its arrival index (unique within the round)."""
    node: str
    infra_rank: int | None = None

    @classmethod
    def from_row(cls, index: int, row: list[object]) -> Arrival:
        """A candidate from its descriptor row; a foreign-version stub has a name and no infra
        rank."""
        infra = row[5] if len(row) > 5 and isinstance(row[5], int) else None
        return cls(index, str(row[1]), infra)


@dataclasses.dataclass(frozen=True)
class RoundView:
    """What the node that may close the round knows about it."""

    max_nodes: int
    min_nodes: int
    arrivals: tuple[Arrival, ...]
    """In arrival order."""
    owners: tuple[str | int, ...] = ()
    """Slot `i`'s owner: a node name (`str`: the previous round's) or an infra rank (`int`)."""
    by_infra: bool = False
    """Spares take vacant slots in infra-rank order (else in arrival order)."""
    gone: frozenset[str | int] = frozenset()
    """Owners known not to come: their slots go to spares without waiting."""
    capacity: int | None = None
    """The most nodes that can still take part (`max_nodes` less the unhealthy and the gone)."""
    last_call_over: bool = False
    """`last_call_timeout` has passed since `min_nodes` were there: wait for nobody else."""
    aside: frozenset[str] = frozenset()
    """Nodes that give up their slot this round (a step is re-run elsewhere): the round still
    waits for them to arrive, then other spares take it first; one of them takes a slot only
    when no other node can."""


def plan_round(view: RoundView) -> tuple[Arrival, ...] | None:
    """The round's participants in slot (group-rank) order, or None to keep waiting."""
    first_of_owner: dict[str | int, Arrival] = {}
    for arrival in view.arrivals:
        first_of_owner.setdefault(arrival.node, arrival)
        if arrival.infra_rank is not None:
            first_of_owner.setdefault(arrival.infra_rank, arrival)
    owned = [
        None if owner in view.aside else first_of_owner.get(owner)
        for owner in view.owners[: view.max_nodes]
    ]
    # An owner stepping aside is waited for too: its arrival means its stop is over (the
    # re-run's checkpoint replicated); closing without it restored nothing for the re-run.
    pending = [
        owner
        for owner in view.owners[: view.max_nodes]
        if owner not in first_of_owner and owner not in view.gone
    ]
    if pending and not view.last_call_over:
        return None
    slots = owned + [None] * (view.max_nodes - len(owned))
    spares = iter(standbys(view.arrivals, slots, view.by_infra, view.aside))
    filled = [arrival if arrival is not None else next(spares, None) for arrival in slots]
    nodes = tuple(arrival for arrival in filled if arrival is not None)
    if len(nodes) == view.max_nodes:
        return nodes
    if len(nodes) < view.min_nodes:
        return None
    capacity = view.max_nodes if view.capacity is None else view.capacity
    if len(nodes) >= capacity or view.last_call_over:
        return nodes
    return None


def standbys(
    arrivals: tuple[Arrival, ...],
    taken: list[Arrival | None] | tuple[Arrival, ...],
    by_infra: bool,
    aside: frozenset[str] = frozenset(),
) -> list[Arrival]:
    """Arrivals not in `taken`, in the order they take vacant slots (those stepping aside
    last)."""
    used = {arrival.index for arrival in taken if arrival is not None}
    rest = [arrival for arrival in arrivals if arrival.index not in used]
    if by_infra:
        rest.sort(key=lambda a: (a.infra_rank is None, a.infra_rank or 0, a.index))
    return sorted(rest, key=lambda a: a.node in aside)  # stable: the order above otherwise
