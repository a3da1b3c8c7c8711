"""Which etcd member a launcher asks: the one its pid picks first (`spread_start`), and not one
that its clients saw stop answering (`MemberHealth`)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

log = logging.getLogger("ftrun.rendezvous")


class MemberHealth:
    """Which members stopped answering, as the clients of one launcher saw it: shared by them
    (`EtcdStore(health=...)`), so that a member going away costs one log line a launcher, not
    one a client, and a client made afterwards (the restart watch makes one each cycle) starts
    on a member that answers rather than on the one its pid picks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: set[str] = set()

    def is_down(self, member: str) -> bool:
        with self._lock:
            return member in self._down

    def first_answering(self, members: Sequence[str], index: int) -> int:
        """The index of the first of `members`, from `index` on (modulo their number), that no
        client of this launcher saw go away; `index` itself when none answers (one may be
        back)."""
        index %= len(members)
        for step in range(len(members)):
            candidate = (index + step) % len(members)
            if not self.is_down(members[candidate]):
                return candidate
        return index

    def mark_down(self, member: str, exc: Exception) -> None:
        with self._lock:
            if member in self._down:
                return
            self._down.add(member)
        log.warning("etcd member %s does not answer (%s); using the others",
                    member, type(exc).__name__)  # fmt: skip

    def mark_up(self, member: str) -> None:
        with self._lock:
            if member not in self._down:
                return
            self._down.discard(member)
        log.info("etcd member %s answers again", member)


def spread_start(members: int, pid: int | None = None) -> int:
    """The member a launcher asks first: its process id modulo the members. Each member then
    serves about a third of the job's nodes (etcd's own client spreads its connections over
    the endpoints alike): at 4,096 nodes on one member, that member's JSON gateway was what
    timed out. Every client of one launcher starts on the same member."""
    return (os.getpid() if pid is None else pid) % members
