"""The monitor thread's deadline heap: each peer's earliest deadline, armed once.

Only an earlier deadline is pushed for a peer; a later one waits until the armed one pops
(the server then re-checks the peer and re-arms), so a heartbeat costs no heap operation.
A popped deadline that was superseded by an earlier one for the same peer is skipped.
"""

from __future__ import annotations

import heapq


class Deadlines:
    """Deadlines keyed by peer (its ZeroMQ identity); not thread-safe (the monitor thread's)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, bytes]] = []
        self._armed: dict[bytes, float] = {}

    def arm(self, identity: bytes, rank: int, deadline: float) -> None:
        """Arm `deadline` for the peer unless an earlier one is armed already."""
        armed = self._armed.get(identity)
        if armed is None or deadline < armed:
            self._armed[identity] = deadline
            heapq.heappush(self._heap, (deadline, rank, identity))

    def next(self) -> float | None:
        """The earliest deadline in the heap (possibly superseded), or None."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[bytes]:
        """The peers whose armed deadline is at or before `now`, disarmed, earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, identity = heapq.heappop(self._heap)
            if self._armed.get(identity) != deadline:
                continue  # superseded by an earlier deadline for the same peer
            del self._armed[identity]
            due.append(identity)
        return due
