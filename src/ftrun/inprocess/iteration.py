"""One restart iteration's keys in the coordination store, and the operations on them.

Every rank of the wrapper's world, and under `ft_launcher` every agent, speaks through these
keys (prefix `<iteration>/`); nobody polls:

- `end` is set once the iteration is over, for either reason: every rank completed the wrapped
  function (`completed` reached the world size), or somebody interrupted it (a rank's
  exception, a progress timeout, the agent's hang verdict or a lost process). Each rank's
  watcher blocks on `end` alone, so an interruption reaches every rank in one store round trip.
- an interruption first appends a record (`records`, `record/<n>`: JSON, who and why), then sets
  `interrupted`, then `end`: whoever sees `end` finds the reason already there.
- after an interruption every rank arrives at the iteration barrier (`arrived`); a rank that
  leaves the job (an exception that is not a restart, a failed health check) arrives too, having
  written `terminated/<rank>`; the last to arrive sets `go`.
- `current` (unprefixed) is the newest iteration a rank entered: a replacement process (a rank
  re-forked by the agent after its process died) joins there.

Keys do not pile up, one set per fault: once a rank runs iteration N, every rank is past N-2
(each arrived at N-1's barrier), and `forget_iteration` deletes N-2's keys, each rank its own
and N-2's rank 0 the common ones (the rank assignment's keys of N-2's end included).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterable
from typing import Any

from torch.distributed import Store

CURRENT_KEY = "current"
_CHUNK = datetime.timedelta(seconds=1)
_FOREVER = datetime.timedelta(days=365)
"""The watcher's wait: the iteration's end always comes (a completion, an interruption, or
the wrapper's own exit interrupts it); a timed-out wait would only log a warning of torch's."""


@dataclasses.dataclass(frozen=True)
class Interruption:
    """Why an iteration ended early. `rank` None: the agent, not a rank, interrupted it."""

    rank: int | None
    kind: str
    """NVRx's `attribution.Interruption` names: EXCEPTION, BASE_EXCEPTION, SOFT_TIMEOUT,
    HARD_TIMEOUT, TERMINATED (a lost process), UNRESPONSIVE (a hang verdict)."""
    why: str
    at: float
    """time.time() of the fault, for the restart's latency."""

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Interruption:
        return cls.from_fields(json.loads(raw))

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Interruption:
        """From `encode`'s fields (also as a rank's records carry them), missing ones filled."""
        rank = fields.get("rank")
        return cls(rank=rank if isinstance(rank, int) else None,
                   kind=str(fields.get("kind", "?")), why=str(fields.get("why", "")),
                   at=float(fields.get("at", 0.0) or 0.0))  # fmt: skip


def root_cause(causes: list[Interruption]) -> Interruption | None:
    """The fault a restart recovered from: the agent's own verdict (a lost process, a hang) over
    the ranks' errors that followed from it (gloo's "connection closed" in a peer can be
    recorded milliseconds before the agent's), else the earliest."""
    for kind in ("TERMINATED", "UNRESPONSIVE"):
        found = [c for c in causes if c.kind == kind]
        if found:
            return found[0]
    return min(causes, key=lambda c: c.at) if causes else None


class Iteration:
    """Restart iteration `number` of a world of `world_size` ranks, on `store`."""

    def __init__(self, store: Store, number: int, world_size: int) -> None:
        self.store, self.number, self.world_size = store, number, world_size
        self._prefix = f"{number}/"

    def key(self, name: str) -> str:
        return self._prefix + name

    def enter(self) -> None:
        """This rank runs the iteration (a replacement process joins the newest one)."""
        self.store.set(CURRENT_KEY, str(self.number))

    def interrupt(self, interruption: Interruption) -> None:
        """End the iteration early, with a reason (every rank restarts)."""
        index = self.store.add(self.key("records"), 1)
        self.store.set(self.key(f"record/{index}"), interruption.encode())
        self.store.set(self.key("interrupted"), b"1")
        self.store.set(self.key("end"), b"interrupted")

    def complete(self) -> None:
        """This rank's function returned; the last rank to complete ends the iteration."""
        if self.store.add(self.key("completed"), 1) >= self.world_size:
            self.store.set(self.key("end"), b"completed")

    def wait_end(self, timeout: datetime.timedelta = _FOREVER) -> bool:
        """True once the iteration is over (False: still running after `timeout`)."""
        return _wait(self.store, [self.key("end")], timeout)

    def was_interrupted(self) -> bool:
        return self.store.check([self.key("interrupted")])

    def interruptions(self) -> list[Interruption]:
        count = self.store.add(self.key("records"), 0)
        keys = [self.key(f"record/{index}") for index in range(1, count + 1)]
        return [Interruption.decode(raw) for raw in self.store.multi_get(keys)] if keys else []

    def arrive(self, rank: int, leaving: bool = False) -> None:
        """This rank is ready for the next iteration (`leaving`: it stops here instead)."""
        if leaving:
            self.store.set(self.key(f"terminated/{rank}"), b"1")
        if self.store.add(self.key("arrived"), 1) >= self.world_size:
            self.store.set(self.key("go"), b"1")

    def wait_go(self, timeout: datetime.timedelta = _CHUNK) -> bool:
        """True once every rank of the iteration has arrived at its barrier."""
        return _wait(self.store, [self.key("go")], timeout)

    def terminated(self, ranks: Iterable[int]) -> set[int]:
        """Which of `ranks` left at this iteration's barrier."""
        return {r for r in ranks if self.store.check([self.key(f"terminated/{r}")])}


_COMMON = ("records", "interrupted", "end", "completed", "arrived", "go")


def forget_iteration(store: Store, number: int, rank: int | None) -> None:
    """Delete iteration `number`'s keys that no rank reads any more: those of rank `rank` (this
    process's rank in that iteration; None: it had none) and, from rank 0, the common ones.
    Call it only once every rank is past the iteration (see the module's doc). The first
    assignment's keys (`ra/start/`) stay: a replacement process gathers with them."""
    if rank is None:
        return
    assignment = f"ra/{number}/ra/"
    seq = f"{assignment}seq/{rank}"
    if store.check([seq]):
        gathers = store.add(seq, 0)
        for key in [f"{assignment}key/{n}/{rank}" for n in range(1, gathers + 1)] + [seq]:
            store.delete_key(key)
    if rank != 0:
        return
    prefix = f"{number}/"
    records = store.add(prefix + "records", 0) if store.check([prefix + "records"]) else 0
    for name in [f"record/{n}" for n in range(1, records + 1)] + list(_COMMON):
        store.delete_key(prefix + name)


def newest_iteration(store: Store) -> int:
    """The newest iteration a rank entered (0 before any did)."""
    return int(store.get(CURRENT_KEY)) if store.check([CURRENT_KEY]) else 0


def _wait(store: Store, keys: list[str], timeout: datetime.timedelta) -> bool:
    try:
        store.wait(keys, timeout)
    except RuntimeError as error:  # DistStoreError: the wait timed out; others: store is gone
        if "timeout" in str(error).lower() or "timed out" in str(error).lower():
            return False
        raise
    return True
