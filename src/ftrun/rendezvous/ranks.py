"""Who is who after a round: node descriptors, group ranks and worker rank ranges (pure)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ftrun.rendezvous.errors import DESCRIPTOR_VERSION, DescriptorVersionError, InfraRankError

INFRA_RANK_VARS = ("SLURM_PROCID", "SLURM_NODEID", "GROUP_RANK")


class NodeDescriptor(NamedTuple):
    """What a node tells the others when it joins a round.

    A NamedTuple, not a dataclass: every node builds all N descriptors of a round, and at 1024
    nodes a frozen dataclass's constructor alone costs 2 ms of CPU per node.

    Two encodings, both carrying `DESCRIPTOR_VERSION`: `to_json` (one node's own key, fields by
    name) and `to_row` (`[version, *fields]`, the rows of the barrier's published round). A
    descriptor of any other version is refused with `DescriptorVersionError`; new fields go at
    the end with a default, and any change of fields bumps the version.
    """

    node: str
    host: str
    local_world_size: int
    master_port: int
    infra_rank: int | None = None
    peer_port: int = 0
    """The agent's peer channel (`ftrun.peer`) on `host`; 0 when it serves none."""

    def to_json(self) -> bytes:
        return json.dumps({"version": DESCRIPTOR_VERSION, **self._asdict()}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeDescriptor:
        fields = _json_object(raw)
        version = fields.pop("version", 1)
        if version != DESCRIPTOR_VERSION:
            raise DescriptorVersionError(fields.get("node", "?"), version)
        return cls(**fields)

    def to_row(self) -> list[object]:
        return [DESCRIPTOR_VERSION, *self]

    @classmethod
    def from_rows(cls, rows: list[list[object]]) -> list[NodeDescriptor]:
        """A published round's rows; as fast as building the tuples alone (1024 per node)."""
        if any(row[0] != DESCRIPTOR_VERSION or len(row) != _ROW_LENGTH for row in rows):
            for row in rows:
                cls.from_row(row)
        new = tuple.__new__
        return [new(cls, row[1:]) for row in rows]  # type: ignore[misc]

    @classmethod
    def from_row(cls, row: list[object]) -> NodeDescriptor:
        if row[0] == DESCRIPTOR_VERSION and len(row) == _ROW_LENGTH:
            return cls(*row[1:])  # type: ignore[arg-type]
        if len(row) == 2:  # `row_from_json`'s [version, node] for a foreign descriptor
            raise DescriptorVersionError(row[1], row[0])
        if isinstance(row[0], str):  # version 1 rows (before versioning) start with the node
            raise DescriptorVersionError(row[0], 1)
        node = row[1] if len(row) > 1 else "?"
        if row[0] == DESCRIPTOR_VERSION:
            fields = f"{len(row) - 1} fields, not {_ROW_LENGTH - 1}"
            raise DescriptorVersionError(node, f"{DESCRIPTOR_VERSION} with {fields}")
        raise DescriptorVersionError(node, row[0])


_ROW_LENGTH = 1 + len(NodeDescriptor._fields)


def row_from_json(raw: bytes | str) -> list[object]:
    """One node's own key as a row of the published round, whatever its version.

    The node that closes a round must publish it even when a descriptor is of another version,
    so that every participant fails with the same `DescriptorVersionError` (in `from_row`)
    rather than the closer alone and the others at their join timeout.
    """
    try:
        return NodeDescriptor.from_json(raw).to_row()
    except DescriptorVersionError as exc:
        return [exc.version, exc.node]


def _json_object(raw: bytes | str) -> dict[str, object]:
    try:
        fields = json.loads(raw)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        # Not this format at all: a release that encodes descriptors differently.
        raise DescriptorVersionError("?", "unknown")
    return fields


@dataclasses.dataclass(frozen=True)
class Round:
    """The outcome of one rendezvous round, identical on every participating node."""

    number: int
    nodes: tuple[NodeDescriptor, ...]
    """Participants ordered by group rank."""
    group_rank: int
    standby: tuple[str, ...] = ()
    """Nodes that arrived but wait as hot spares for a later cycle."""
    stalled_cycles: int = 0
    """Cycles in a row, just before this one, whose ranks made no progress (see `published`)."""
    progress_known: bool = False
    """A rank reported an iteration in an earlier cycle, so `stalled_cycles` judges progress (a
    job that reports none is never judged: it may not use the client)."""
    arrived_at: float | None = dataclasses.field(default=None, compare=False)
    """This node's own: when (its monotonic clock) it arrived for this round, if the rendezvous
    knows (a standby node arrives again when the cycle it waited through ends); not shared."""

    @property
    def me(self) -> NodeDescriptor:
        return self.nodes[self.group_rank]

    @property
    def world_size(self) -> int:
        return sum(n.local_world_size for n in self.nodes)

    @property
    def first_global_rank(self) -> int:
        return sum(n.local_world_size for n in self.nodes[: self.group_rank])

    def ranks_of(self, node: str) -> range:
        """The global ranks `node` holds in this round (empty when it is not in it)."""
        first = 0
        for descriptor in self.nodes:
            if descriptor.node == node:
                return range(first, first + descriptor.local_world_size)
            first += descriptor.local_world_size
        return range(0)

    @property
    def master(self) -> NodeDescriptor:
        return self.nodes[0]


def infra_rank_from_env(environ: Mapping[str, str], node_rank: int | None) -> int | None:
    """The scheduler's rank for this node: SLURM_PROCID, SLURM_NODEID, GROUP_RANK, --node-rank."""
    for name in INFRA_RANK_VARS:
        value = environ.get(name)
        if value is not None and value != "":
            try:
                return int(value)
            except ValueError:
                raise InfraRankError(f"{name}={value!r} is not an integer") from None
    return node_rank


def order_nodes(
    arrivals: Sequence[NodeDescriptor], use_infra_group_rank: bool
) -> tuple[NodeDescriptor, ...]:
    """Group-rank order: by infra rank when asked (each present and unique), else arrival."""
    if not use_infra_group_rank:
        return tuple(arrivals)
    missing = [d.node for d in arrivals if d.infra_rank is None]
    if missing:
        raise InfraRankError(
            f"--ft-use-infra-group-rank but node(s) {', '.join(missing)} have no infra rank "
            f"(none of {', '.join(INFRA_RANK_VARS)} is set)"
        )
    seen: dict[int, str] = {}
    for d in arrivals:
        assert d.infra_rank is not None
        if d.infra_rank in seen:
            raise InfraRankError(
                f"nodes {seen[d.infra_rank]} and {d.node} both have infra rank {d.infra_rank}"
            )
        seen[d.infra_rank] = d.node
    return tuple(sorted(arrivals, key=lambda d: d.infra_rank or 0))


def infra_rank_error(rows: Iterable[list[object]], use_infra: bool) -> str | None:
    """With infra ranks, every arrival of the first round needs a unique one: what is wrong
    with the arrivals' descriptor rows, or None (a foreign-version row is published as is:
    every participant refuses it alike)."""
    if not use_infra:
        return None
    try:
        order_nodes([NodeDescriptor.from_row(row) for row in rows], True)
    except InfraRankError as exc:
        return str(exc)
    except DescriptorVersionError:
        return None
    return None
