"""The job's keys on etcd go away with the job: every key a launcher puts is attached to one lease
per launch, which the launchers keep alive while they use the store.

etcd outlives jobs. Without a lease, every launch would leave its rounds, descriptors, progress
records and counters in etcd for good, and a shared etcd fills up (its default backend quota is
2 GB; past it, etcd refuses every write, for every job). The first launcher of a launch grants a
lease of `JOB_LEASE_TTL_S` and writes its id under the launch's prefix (attached to the lease
itself); the others read it there. Each client refreshes it at most every third of the TTL, in
the course of its own requests (no thread): a launcher talks to the store every few seconds
while it lives. Once every launcher of the job has stopped, etcd deletes the job's keys within
the TTL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

JOB_LEASE_TTL_S = 600
"""How long the job's keys outlive its last launcher (seconds, etcd's lease TTL)."""
LEASE_KEY = "lease"
"""Under the launch's prefix: the id of the job's lease (decimal)."""


class JobLease:
    """One launch's etcd lease, shared by the clients of a launcher: which of them refreshes it,
    and when."""

    def __init__(
        self, lease_id: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._due = clock() + ttl_s / 3

    def take_refresh(self) -> bool:
        """True for the one caller that should refresh the lease now (the next is due a third
        of the TTL later)."""
        if self._clock() < self._due:  # every request asks: no lock until one is due
            return False
        with self._lock:
            now = self._clock()
            if now < self._due:
                return False
            self._due = now + self.ttl_s / 3
            return True
