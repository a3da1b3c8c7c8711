"""Job-wide signalling through the store: the cycle number, restarts, shutdown, exit barriers.

One cycle number for the whole job: a restart is a vote on cycle `c`; the first voter moves the
job to `c + 1`, so when several nodes fail at once exactly one bump (and one failure count)
happens. Every agent watches
`c<c>/next` with one cheap `check` per monitor interval. Shared by both rendezvous
implementations.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable

from torch.distributed import Store

from ftrun.errors import ExitCode, RendezvousFailedError
from ftrun.store.ops import existing_keys, get_if_exists, read_now, wait_for_key, wait_for_keys


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """One failure of the job's history: which node failed in which cycle, and how (the
    `Signature.key` of `agent.diagnosis.attribution`), and where: the global ranks the node held
    in that cycle, which tell a fault that follows the node from one that follows the ranks
    (empty when the writer did not know)."""

    cycle: int
    node: str
    key: str
    ranks: range = range(0)

    def to_line(self) -> str:
        """One line of the store's log: `[cycle, node, key]`, then `first, end` of the ranks
        when known (appended, so that a line without them still reads)."""
        fields: list[object] = [self.cycle, self.node, self.key]
        if self.ranks:
            fields += [self.ranks.start, self.ranks.stop]
        return json.dumps(fields) + "\n"

    @classmethod
    def from_line(cls, line: str) -> FailureRecord:
        cycle, node, key, *where = json.loads(line)
        ranks = range(int(where[0]), int(where[1])) if len(where) >= 2 else range(0)
        return cls(int(cycle), str(node), str(key), ranks)


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """The job is ending: every agent exits with `code`."""

    code: ExitCode
    reason: str


@dataclasses.dataclass
class KnownState:
    """The job's state as this agent last read or wrote it: what it writes back into a store
    that restarted empty (`JobControl.restore`)."""

    cycle: int = 0
    failures: int = 0
    failure_log: bytes = b""
    shutdown: bytes = b""


def job_control(store: Store, run_id: str) -> JobControl:
    """The job's control keys: the one place their prefix is made."""
    return JobControl(store, f"ftrun/{run_id}")


class JobControl:
    """Typed access to the job's control keys under `prefix`."""

    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self.prefix = prefix
        """The job's key prefix (`ftrun/<run id>`); the rendezvous keys its rounds under it."""
        self._store.compare_set(self._key("cycle"), "", "0")
        self.known = KnownState()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def cycle(self) -> int:
        self.known.cycle = int(self._store.get(self._key("cycle")))
        return self.known.cycle

    def failures(self) -> int:
        """Failure restarts so far (scale-up restarts do not count against the budget)."""
        self.known.failures = self._store.add(self._key("failures"), 0)
        return self.known.failures

    def restore(self, cycle: int) -> None:
        """Write the job's state back into a store that restarted empty, from what this agent
        knows: the job moves to a fresh cycle (the first agent's `cycle`, after every cycle any
        of them saw, wins), one failure more than the most any agent counted (the store's loss
        ends the running cycle, once), and the first agent's copy of the failure history and of
        a shutdown request."""
        self._store.compare_set(self._key("cycle"), "", str(max(cycle, self.known.cycle) + 1))
        self._raise_to("failures", self.known.failures + 1)
        if self.known.failure_log:
            self._store.compare_set(self._key("failure_log"), "", self.known.failure_log)
        if self.known.shutdown:
            self._store.compare_set(self._key("shutdown"), "", self.known.shutdown)

    def _raise_to(self, name: str, value: int) -> None:
        """Set a counter to `value` unless another agent set it higher (never lowered)."""
        key = self._key(name)
        current = self._store.compare_set(key, "", str(value))
        while int(current) < value:
            current = self._store.compare_set(key, current, str(value))

    def request_restart(
        self, cycle: int, cause: str, failure: bool = True, rerun: bool = False
    ) -> bool:
        """Move the job from `cycle` to the next; True if this call made the move. `rerun`: the
        move re-runs a step elsewhere (counted by `rerun_restarts`)."""
        # The first vote wins: a compare-and-set of a token no other call writes. Not a counter
        # (`add(votes, 1) == 1`): a store client that resends an increment whose answer it lost
        # (etcd, a member that stops answering) counts it twice, and then nobody wins the vote.
        # Nor a set of the cycle itself: its winner and a loser finding its value look alike.
        token = uuid.uuid4().hex
        won = self._store.compare_set(self._key(f"c{cycle}/vote"), "", token) == token.encode()
        if won:
            if failure:
                self.known.failures = self._store.add(self._key("failures"), 1)
            if rerun:
                self._store.set(self._key(f"c{cycle}/rerun"), "1")
            self._store.set(self._key(f"c{cycle}/cause"), cause)
            self._store.set(self._key("cycle"), str(cycle + 1))
            self.known.cycle = max(self.known.cycle, cycle + 1)
            self._store.set(self.restart_key(cycle), "1")
        return won

    def restart_key(self, cycle: int) -> str:
        """The key whose existence ends `cycle` (`request_restart` sets it last)."""
        return self._key(f"c{cycle}/next")

    def restart_requested(self, cycle: int) -> bool:
        return self._store.check([self.restart_key(cycle)])

    def cause_of(self, cycle: int) -> str | None:
        """Why `cycle` ended; None while it has not (never waits: `get` would, on a missing key)."""
        cause = get_if_exists(self._store, self._key(f"c{cycle}/cause"))
        return None if cause is None else cause.decode()

    def wait_restart(self, cycle: int, timeout: float) -> bool:
        """Block until `cycle` ends or `timeout` passes; True if it ended."""
        return wait_for_key(self._store, self.restart_key(cycle), timeout)

    def shutdown(self, code: ExitCode, reason: str, cycle: int) -> Shutdown:
        """Ask every agent to exit; the first request wins. Returns the one in force."""
        blob = json.dumps({"code": int(code), "reason": reason})
        self._store.compare_set(self._key("shutdown"), "", blob)
        self.request_restart(cycle, reason, failure=False)
        current = self.shutdown_requested()
        assert current is not None
        return current

    def shutdown_requested(self) -> Shutdown | None:
        return self._shutdown(get_if_exists(self._store, self._key("shutdown")))

    def shutdown_and_cycle(self) -> tuple[Shutdown | None, int]:
        """`shutdown_requested()` and `cycle()`, in one request on a store that reads several
        keys at once without waiting (`EtcdStore.read_now`: a barrier round's first look)."""
        found = read_now(self._store, [self._key("shutdown"), self._key("cycle")])
        if found is None:
            return self.shutdown_requested(), self.cycle()
        shutdown, cycle = found
        if cycle is None:  # put when the job's first agent began: only a store that restarted
            return self._shutdown(shutdown), self.cycle()
        self.known.cycle = int(cycle)
        return self._shutdown(shutdown), self.known.cycle

    def shutdown_and_counts(self, counters: list[str]) -> tuple[Shutdown | None, list[int]]:
        """`shutdown_requested()` and the counts of the counter keys `counters` (full keys;
        absent: 0), in one request on a store that reads several keys at once (a node waiting
        for a round looks so every few seconds: 1 request, not 4)."""
        found = read_now(self._store, [self._key("shutdown"), *counters])
        if found is None:
            return self.shutdown_requested(), [self._store.add(key, 0) for key in counters]
        shutdown, *counts = found
        return self._shutdown(shutdown), [0 if count is None else int(count) for count in counts]

    def _shutdown(self, blob: bytes | None) -> Shutdown | None:
        """The shutdown request `blob` says (None: there is none)."""
        if blob is None:
            return None
        self.known.shutdown = blob
        raw = json.loads(blob)
        return Shutdown(ExitCode(raw["code"]), raw["reason"])

    def report_unhealthy(self, cycle: int, node: str, reason: str) -> None:
        """This node will not join `cycle`; the others stop waiting for it."""
        self._store.set(self.unhealthy_key(cycle, node), reason)
        self._store.add(self._key(f"c{cycle}/unhealthy"), 1)

    def healthy_capacity(
        self,
        cycle: int,
        min_nodes: int,
        max_nodes: int,
        arrived: int = 0,
        unhealthy: int | None = None,
    ) -> int:
        """How many nodes can still join `cycle`; raises once that is fewer than `min_nodes`.

        The healthy nodes are at least those that arrived (standby nodes beyond `max_nodes`
        included), and at most `max_nodes` less the unhealthy when no more come (`unhealthy`:
        their count, read already; None: read it).
        """
        if unhealthy is None:
            unhealthy = self._store.add(self._key(f"c{cycle}/unhealthy"), 0)
        possible = max(max_nodes - unhealthy, arrived)
        if possible < min_nodes:
            raise RendezvousFailedError(
                f"at most {possible} healthy node(s) can join, {min_nodes} needed "
                "(see the unhealthy node's log)"
            )
        return possible

    def mark_gone(self, node: str, reason: str) -> None:
        """This node leaves the job for good: rounds stop keeping a slot for it."""
        self._store.set(self._key(f"gone/{node}"), reason)

    def step_aside(self, node: str, cycle: int) -> None:
        """`node` gives up its slot in `cycle` and stands by: a step must be re-run elsewhere."""
        self._store.append(self._key(f"c{cycle}/aside"), node + "\n")

    def stepped_aside(self, cycle: int) -> frozenset[str]:
        """The nodes that give up their slot in `cycle` (one read, whatever the job's size)."""
        aside = get_if_exists(self._store, self._key(f"c{cycle}/aside")) or b""
        return frozenset(filter(None, aside.decode().splitlines()))

    def restarted_for_rerun(self, cycle: int) -> bool:
        """Whether `cycle` ended with a restart for a re-run elsewhere (`request_restart`)."""
        return self._store.check([self._key(f"c{cycle}/rerun")])

    def settle_rerun(self, cycle: int) -> None:
        """A re-run reached its verdict in `cycle`: the suspects that stepped aside for it count
        as standby nodes again, and a later re-run request is a new one, not a repeat."""
        self._store.set(self._key(f"c{cycle}/rerun_verdict"), "1")

    def rerun_settled(self, cycle: int) -> bool:
        return self._store.check([self._key(f"c{cycle}/rerun_verdict")])

    def rerun_restarts(self, cycle: int, limit: int) -> int:
        """Re-run restarts in a row that ended the cycles just before `cycle` (at most `limit`
        counted), back to the first that reached a verdict: what a re-run request in `cycle`
        repeats. 0 once `cycle` reached a verdict itself (a later request is a new one)."""
        if self.rerun_settled(cycle):
            return 0
        count = 0
        for earlier in range(cycle - 1, max(cycle - 1 - limit, -1), -1):
            if not self.restarted_for_rerun(earlier):
                break
            count += 1
            if self.rerun_settled(earlier):
                break
        return count

    def left_on_purpose(self, node: str, cycle: int) -> bool:
        """Whether `node` said why it is not in `cycle`: it left the job, or was unhealthy."""
        said = self._store.check([self.gone_key(node)]) or self._store.check(
            [self.unhealthy_key(cycle, node)]
        )
        return said or node in self.stepped_aside(cycle + 1)

    def gone_key(self, node: str) -> str:
        return self._key(f"gone/{node}")

    def unhealthy_key(self, cycle: int, node: str) -> str:
        return self._key(f"c{cycle}/unhealthy/{node}")

    def report_progress(self, cycle: int, node: str, iteration: int | None) -> None:
        """The highest iteration this node's ranks reported in `cycle` (None: none reported)."""
        self._store.set(self.progress_key(cycle, node), json.dumps(iteration))

    def progress_key(self, cycle: int, node: str) -> str:
        return self._key(f"c{cycle}/progress/{node}")

    def record_failure(self, record: FailureRecord) -> None:
        """Add a failure to the job's history (one atomic append: nodes never overwrite)."""
        line = record.to_line()
        self._store.append(self._key("failure_log"), line)
        self.known.failure_log += line.encode()

    def failure_history(self) -> tuple[FailureRecord, ...]:
        """The job's failures so far, oldest first (kept in the store for the job's life)."""
        raw = get_if_exists(self._store, self._key("failure_log"))
        if raw is None:
            return ()
        self.known.failure_log = raw
        return tuple(map(FailureRecord.from_line, raw.decode().splitlines()))

    def request_collectives(self, cycle: int) -> None:
        """A hang in `cycle`: every node dumps its ranks' flight recorders before its stop."""
        self._store.set(self._key(f"c{cycle}/fr_request"), "1")

    def collectives_requested(self, cycle: int) -> bool:
        return self._store.check([self._key(f"c{cycle}/fr_request")])

    def publish_collectives(self, cycle: int, node: str, summary: str) -> None:
        self._store.set(self._key(f"c{cycle}/fr/{node}"), summary)

    def collectives(self, cycle: int, nodes: list[str], timeout: float) -> dict[str, str]:
        """The nodes' published summaries, waiting up to `timeout` for all of them."""
        keys = {self._key(f"c{cycle}/fr/{node}"): node for node in nodes}
        wait_for_keys(self._store, list(keys), timeout)
        return {
            keys[k]: self._store.get(k).decode() for k in existing_keys(self._store, list(keys))
        }

    def arrive(self, cycle: int, barrier: str) -> int:
        """Count this node into a per-cycle barrier (`succeeded`, `left`); returns the count."""
        return self._store.add(self._key(f"c{cycle}/{barrier}"), 1)

    def count(self, cycle: int, barrier: str) -> int:
        return self._store.add(self._key(f"c{cycle}/{barrier}"), 0)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float) -> bool:
    """Poll `predicate` until true or `timeout`; for counts the store cannot wait on."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
