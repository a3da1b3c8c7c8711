"""The in-process tier's protocol: what wrapped ranks and their node's agent say to each other.

Both sides import this module, and it stays light (no torch, no zmq, no psutil): the agent
never imports `ftrun.inprocess`. Two directions, each over a channel that exists anyway:

- **ranks -> agent: `Report`s**, fire-and-forget frames on the rank monitor's connection
  (`rank_monitor.protocol.InprocessNote`), each naming its rank and pid, checked by the monitor
  as it checks a HELLO: a wrapped rank says it wraps (and where its ranks coordinate), that an
  iteration recovered (the root cause, the seconds), that it left, that it gave up. The agent
  learns of each the moment it is sent; nothing is written to disk, nothing is polled.
- **agent -> ranks, and rank <-> rank: the coordination store's keys** (`Iteration`), the
  job's own store under ft_launcher. A hang verdict or a lost process is written there as a
  rank's own fault would be, through the agent's existing store client: every rank's watcher,
  blocked on the iteration's `end`, wakes at once.

One restart budget governs both sides (`RestartBudget`, from the launch config, handed to the
ranks in `Env.INPROCESS_BUDGET`): how many in-process restarts within a window before the next
rung of the ladder, whoever started them; and a fault that ends iterations the same way in a
row (`RestartBudget.same_in_a_row`) is not tried again in-process.

**Iteration keys.** Every rank of the wrapper's world, and under `ft_launcher` every agent,
speaks through these keys (prefix `<iteration>/`); nobody polls:

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
import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ftrun import untrusted_json
from ftrun.environment import Env
from ftrun.errors import ProtocolError

if TYPE_CHECKING:
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
        """From `encode`'s bytes, missing or malformed fields filled: a record in the job's
        store that no rank wrote is still an interruption, never an error in the reader."""
        try:
            fields = untrusted_json.loads(raw)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            return cls(rank=None, kind="?", why=f"an unreadable record ({bytes(raw[:40])!r})",
                       at=0.0)  # fmt: skip
        rank, at = fields.get("rank"), fields.get("at")
        at = float(at) if type(at) in (int, float) and abs(at) < 1e18 else 0.0
        return cls(rank=rank if type(rank) is int else None,
                   kind=str(fields.get("kind", "?"))[:64], why=str(fields.get("why", ""))[:1000],
                   at=at)  # fmt: skip


def root_cause(causes: list[Interruption]) -> Interruption | None:
    """The fault a restart recovered from: the agent's own verdict (a lost process, a hang) over
    the ranks' errors that followed from it (gloo's "connection closed" in a peer can be
    recorded milliseconds before the agent's), else the earliest."""
    for kind in ("TERMINATED", "UNRESPONSIVE"):
        found = [c for c in causes if c.kind == kind]
        if found:
            return found[0]
    return min(causes, key=lambda c: c.at) if causes else None


def cause_text(cause: Interruption | None) -> str:
    """A root cause as the budget compares and names it: both sides count by this text."""
    return f"{cause.kind}: {cause.why}" if cause is not None else "unknown"


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


# ---- ranks -> agent: reports ------------------------------------------------------------------

MAX_TEXT_LEN = 500
"""A report's `why`, and an interruption's, are cut to this many characters."""
MAX_ADDRESS_LEN = 300
MAX_KIND_LEN = 32


class ReportKind(enum.Enum):
    WRAPPED = "wrapped"
    """The rank runs the wrapper in this cycle; `address` and `prefix`: its coordination store."""
    RECOVERED = "recovered"
    """Restart iteration `iteration` ended and every rank reached its barrier (`cause`,
    `seconds`: from the fault to the barrier)."""
    LEFT = "left"
    """The rank leaves the job at `iteration` (`why`); the others go on without it."""
    GAVE_UP = "gave_up"
    """In-process restart cannot cure it (`why`): the rank's process ends, the agent takes the
    next rung."""


@dataclasses.dataclass(frozen=True)
class Report:
    """What one wrapped rank tells its node's agent."""

    kind: ReportKind
    cycle: int | None
    """The launcher's cycle the rank was started in (`Env.CYCLE`)."""
    iteration: int = 0
    why: str = ""
    cause: Interruption | None = None
    seconds: float | None = None
    address: str = ""
    prefix: str = ""

    def to_wire(self) -> list[Any]:
        """Texts cut to their limits, so that no report is refused for its length."""
        c = self.cause
        cause = None if c is None else [c.rank, c.kind[:MAX_KIND_LEN], c.why[:MAX_TEXT_LEN], c.at]
        return [self.kind.value, self.cycle, self.iteration, self.why[:MAX_TEXT_LEN], cause,
                self.seconds, self.address, self.prefix]  # fmt: skip

    @classmethod
    def from_wire(cls, raw: object) -> Report:
        """Validated; anything unexpected raises `ProtocolError`."""
        if not isinstance(raw, list) or len(raw) != 8:
            raise ProtocolError("an in-process report must be a list of 8 items")
        kind, cycle, iteration, why, cause, seconds, address, prefix = raw
        try:
            kind = ReportKind(kind)
        except ValueError:
            raise ProtocolError(f"unknown in-process report {kind!r}") from None
        return cls(kind=kind, cycle=None if cycle is None else _count(cycle, "cycle"),
                   iteration=_count(iteration, "iteration"), why=_text(why, "why", MAX_TEXT_LEN),
                   cause=None if cause is None else _interruption(cause),
                   seconds=None if seconds is None else _seconds(seconds),
                   address=_text(address, "address", MAX_ADDRESS_LEN),
                   prefix=_text(prefix, "prefix", MAX_ADDRESS_LEN))  # fmt: skip


def _count(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= 2**62:
        raise ProtocolError(f"{what} must be an integer in [0, 2**62]")
    return value


def _text(value: object, what: str, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"{what} must be a string of at most {limit} characters")
    return value


def _seconds(value: object, what: str = "seconds") -> float:
    """A duration, or a `time.time()` stamp: finite and >= 0 (NaN fails the comparison)."""
    if type(value) not in (int, float) or not 0 <= value < 1e12:
        raise ProtocolError(f"{what} must be a finite number >= 0")
    return float(value)


def _interruption(raw: object) -> Interruption:
    if not isinstance(raw, list) or len(raw) != 4:
        raise ProtocolError("a cause must be [rank, kind, why, at]")
    rank, kind, why, at = raw
    return Interruption(
        rank=None if rank is None else _count(rank, "cause rank"),
        kind=_text(kind, "cause kind", MAX_KIND_LEN), why=_text(why, "cause", MAX_TEXT_LEN),
        at=_seconds(at, "cause time"),
    )  # fmt: skip


# ---- one restart budget -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RestartBudget:
    """In-process restarts allowed within `window_s` seconds, whoever started them (a rank's
    fault, the agent's hang verdict, a replaced rank), before the ladder's next rung (the in-job
    restart); and `same_in_a_row`: the same cause ending that many iterations in a row goes to
    the next rung at once (a function that fails on entry will fail again). 0: no limit."""

    max_restarts: int = 3
    window_s: float = 120.0
    same_in_a_row: int = 3

    def exceeded(self, restarts: Iterable[float], causes: Sequence[str], now: float) -> str | None:
        """Why no further in-process restart is made, or None: the newest of `causes`
        (`cause_text` of each ended iteration's root cause, oldest first) ended the last
        `same_in_a_row` iterations alike, or another restart would exceed the budget
        (`restarts`: their times)."""
        n = self.same_in_a_row
        if 0 < n <= len(causes) and len(set(causes[-n:])) == 1:
            return f"the same fault ended {n} iterations in a row: {causes[-1]}"
        if 0 < self.max_restarts <= sum(1 for at in restarts if now - at <= self.window_s):
            return (f"{self.max_restarts} in-process restarts within {self.window_s:g}s did not "
                    f"cure it (last: {causes[-1] if causes else 'unknown'})")  # fmt: skip
        return None

    def to_env(self) -> str:
        return f"{self.max_restarts}/{self.window_s:g}/{self.same_in_a_row}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RestartBudget | None:
        """The budget the launcher handed this rank; None without a launcher (NVRx's
        behaviour: `max_iterations`, if any, is the only bound). A malformed value is one
        `ValueError` line."""
        raw = environ.get(Env.INPROCESS_BUDGET)
        if not raw:
            return None
        try:
            restarts, window, same = raw.split("/")
            budget = cls(int(restarts), float(window), int(same))
        except ValueError:
            raise ValueError(f"{Env.INPROCESS_BUDGET}={raw!r}: expected RESTARTS/WINDOW_S/SAME, "
                             "as the launcher writes it") from None  # fmt: skip
        if budget.max_restarts < 0 or not budget.window_s > 0 or budget.same_in_a_row < 0:
            raise ValueError(f"{Env.INPROCESS_BUDGET}={raw!r}: out of range")
        return budget
