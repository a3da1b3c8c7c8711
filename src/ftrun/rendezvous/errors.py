"""The rendezvous' own errors (the job-level ones, with their exit codes, are `ftrun.errors`)."""

from __future__ import annotations

from ftrun.errors import ExitCode, FtrunError

DESCRIPTOR_VERSION = 3
"""The node descriptor format this release writes and reads (`ranks.NodeDescriptor`). 1: node,
host, local_world_size, master_port, infra_rank, unversioned; 2: + peer_port; 3: same fields,
but the barrier's published round carries slots and standbys (hot spares)."""


class JoinInterruptedError(Exception):
    """The agent asked to stop waiting (a signal arrived)."""


class InfraRankError(FtrunError):
    """Infra group ranks are missing or duplicated; a configuration problem."""

    exit_code = ExitCode.USAGE


class DescriptorVersionError(FtrunError):
    """A node publishes its descriptor in another format: the nodes run different ftrun releases."""

    exit_code = ExitCode.USAGE

    def __init__(self, node: object, version: object) -> None:
        self.node, self.version = node, version
        super().__init__(
            f"node {node} publishes node descriptor version {version}, this ftrun reads version "
            f"{DESCRIPTOR_VERSION}: run the same ftrun release on every node of the job"
        )
