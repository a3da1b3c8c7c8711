"""Which ranks may register with the node's monitor, and the registrations they made.

The owner expects each rank from the process it spawned (`expect`); a HELLO is admitted only
from that process or a descendant of it (`admitted_pid`), so a stray process cannot speak for a
rank. A registration is a `Peer`: the rank's progress, its ZeroMQ identity and the pid the owner
spawned. A re-registration replaces the rank's old connection. While a peer is in `peers` its
deadlines are watched; a verdict or a goodbye removes it there, but `registered` keeps each
rank's latest registration, for `snapshot`, until the owner forgets the ranks (`clear`).

Not thread-safe: the server's lock guards it.
"""

from __future__ import annotations

import dataclasses

import psutil

from ftrun.rank_monitor.records import ProgressSnapshot
from ftrun.rank_monitor.tracker import RankProgress


@dataclasses.dataclass
class Peer:
    progress: RankProgress
    identity: bytes
    spawned_pid: int
    """The pid the owner registered (the HELLO may come from a descendant of it)."""


class RankRegistry:
    """The expected ranks (rank -> spawned pid) and their registrations."""

    def __init__(self) -> None:
        self.expected: dict[int, int] = {}  # rank -> pid the owner spawned
        self.peers: dict[bytes, Peer] = {}  # ZeroMQ identity -> rank state, watched
        # rank -> its latest registration, kept after a verdict or a goodbye for the snapshot
        self.registered: dict[int, Peer] = {}

    def expect(self, rank: int, pid: int) -> None:
        self.expected[rank] = pid

    def clear(self) -> None:
        self.expected.clear()
        self.peers.clear()
        self.registered.clear()

    def admitted_pid(self, rank: int, pid: int) -> int | None:
        """The pid spawned for `rank` if `pid` is that process or a descendant; else None."""
        expected_pid = self.expected.get(rank)
        if expected_pid is None or not is_self_or_descendant(pid, expected_pid):
            return None
        return expected_pid

    def register(self, identity: bytes, progress: RankProgress, spawned_pid: int) -> Peer:
        """Register `identity` as the rank's connection, replacing any older one."""
        for other, peer in list(self.peers.items()):
            if peer.progress.rank == progress.rank:
                del self.peers[other]  # a re-registration replaces the old connection
        peer = Peer(progress, identity, spawned_pid)
        self.peers[identity] = self.registered[progress.rank] = peer
        return peer

    def is_current(self, peer: Peer) -> bool:
        """Whether the owner still expects `peer`'s rank from the process it registered from
        (not forgotten, not re-spawned since)."""
        return self.expected.get(peer.progress.rank) == peer.spawned_pid

    def snapshot(self) -> list[ProgressSnapshot]:
        """Where each expected rank's current registration got to, in rank order."""
        peers = [peer for _, peer in sorted(self.registered.items()) if self.is_current(peer)]
        return [
            ProgressSnapshot(
                rank=p.progress.rank,
                pid=p.progress.pid,
                worker_pid=p.spawned_pid,
                first_progress=p.progress.first_progress,
                last_progress=p.progress.last_progress,
                first_iteration=p.progress.first_iteration,
                last_iteration=p.progress.last_iteration,
                timeouts=p.progress.timeouts,
            )
            for p in peers
        ]


def is_self_or_descendant(pid: int, ancestor: int) -> bool:
    if pid == ancestor:
        return True
    try:
        return any(parent.pid == ancestor for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False
