"""Who is who after a round: node descriptors, group ranks and worker rank ranges (pure)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ftrun.errors import ExitCode, FtrunError

INFRA_RANK_VARS = ("SLURM_PROCID", "SLURM_NODEID", "GROUP_RANK")


class InfraRankError(FtrunError):
    """Infra group ranks are missing or duplicated; a configuration problem."""

    exit_code = ExitCode.USAGE


class NodeDescriptor(NamedTuple):
    """What a node tells the others when it joins a round.

    A NamedTuple, not a dataclass: every node builds all N descriptors of a round, and at 1024
    nodes a frozen dataclass's constructor alone costs 2 ms of CPU per node.
    """

    node: str
    host: str
    local_world_size: int
    master_port: int
    infra_rank: int | None = None

    def to_json(self) -> bytes:
        return json.dumps(self._asdict()).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> NodeDescriptor:
        return cls(**json.loads(raw))


@dataclasses.dataclass(frozen=True)
class Round:
    """The outcome of one rendezvous round, identical on every participating node."""

    number: int
    nodes: tuple[NodeDescriptor, ...]
    """Participants ordered by group rank."""
    group_rank: int

    @property
    def me(self) -> NodeDescriptor:
        return self.nodes[self.group_rank]

    @property
    def world_size(self) -> int:
        return sum(n.local_world_size for n in self.nodes)

    @property
    def first_global_rank(self) -> int:
        return sum(n.local_world_size for n in self.nodes[: self.group_rank])

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


def default_node_name(environ: Mapping[str, str], host: str) -> str:
    """Slurm's node name when there is one, else host and pid (several agents per host)."""
    return environ.get("SLURMD_NODENAME") or f"{host}-{os.getpid()}"
