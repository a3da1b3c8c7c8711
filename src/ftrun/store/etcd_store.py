"""torch's `Store` interface on etcd (`--rdzv-backend=etcd`): the store off the training nodes.

With TCPStore, the first agent hosts the job's store and the job ends with that node. etcd is
Raft-replicated: losing any training node, or any etcd member short of a majority, leaves the
store standing. This class speaks etcd's v3 JSON gateway through `etcd3gw` (no grpc stubs) and
keeps TCPStore's semantics, which the rendezvous, job control and the subsystems rely on, so
that nothing above `store/connect.py` knows which backend it has:

- `get`, `multi_get` and `wait` block until their keys exist, up to the store's timeout: one
  read, then one etcd watch on the missing keys (no polling); the values come from the watch's
  events where every key was missing, else from one read after it (`wait` returns none, and
  reads nothing after the watch; `get_within` is `get` with a timeout that says None);
- `add`, `append` and `compare_set` are atomic: one transaction comparing the key's revision
  (or its value), retried when another writer got there first;
- `compare_set` of an absent key with `expected == b""` creates it (TCPStore's rule).

A key that `add` counts holds a marker (`wire.COUNTER` and an offset), its count being the key's
etcd `version` plus the offset: every put bumps the version, so `add(key, 1)` is one put of the
same marker under a compare on the value, which no other increment changes (N nodes arriving
at once: N requests, not a compare-and-swap's O(N^2)). Every read turns the marker into the count.

Every key goes under `/ftrun/<run id>/`, so several jobs share one etcd, and is attached to the
launch's lease (`etcd_lease`: the keys go when the job has gone). Endpoints are tried in
turn, from the one a launcher starts on (`spread_start`): a member that stops answering is left for
the next one, with one log line, and a request fails only when no member has answered for the whole
timeout. A request whose member stopped answering after applying it is sent again, so an `add` or
`append` may count twice (TCPStore's reconnecting client alike): callers decide by a compare-and-set
of a value of their own (`control.request_restart`), and treat counters as upper bounds.
"""

from __future__ import annotations

import base64
import datetime
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception
from etcd3gw.lease import Lease
from torch.distributed import DistStoreError, Store

from ftrun.store import etcd_wire as wire
from ftrun.store.etcd_lease import JobLease
from ftrun.store.etcd_members import MemberHealth

log = logging.getLogger("ftrun.rendezvous")

REQUEST_TIMEOUT_S = 5.0
"""One HTTP request to one member; a member slower than this is skipped for the next."""
MAX_TXN_OPS = 128
"""etcd's default `--max-txn-ops`: a transaction with more operations is refused."""
_POLL_S = (0.005, 0.2)
"""First and longest pause between two tries of a compare-and-swap that lost a race."""
_UNREACHABLE = (ConnectionFailedError, ConnectionTimeoutError)
"""No answer (etcd3gw raises them without args), or an answer saying "not now": 503 while the
members elect a leader, 408/504 (with the HTTP reason as their argument)."""
T = TypeVar("T")


class EtcdAuthError(DistStoreError):
    """etcd refused the request (authentication or permission)."""


class WaitTimeoutError(DistStoreError):
    """Keys still absent at the end of a wait (TCPStore's message: "wait timeout ...")."""


class EtcdStore(Store):
    """A TCPStore stand-in on an etcd cluster, for one job (`run_id`)."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        run_id: str,
        timeout: datetime.timedelta,
        clock: Callable[[], float] = time.monotonic,
        first_member: int = 0,
        health: MemberHealth | None = None,
    ) -> None:
        """`first_member`: the index of the member asked first (see `spread_start`), unless
        `health` (shared with the launcher's other clients) says it stopped answering."""
        super().__init__()
        self._members = [Etcd3Client(host, port, timeout=REQUEST_TIMEOUT_S, api_path="/v3/")
                         for host, port in endpoints]  # fmt: skip
        self._names = [f"{host}:{port}" for host, port in endpoints]
        self.health = health or MemberHealth()
        self._current = self.health.first_answering(self._names, first_member)
        self._prefix = f"/ftrun/{run_id}/"
        self._markers: dict[str, bytes] = {}  # counter key -> its marker, last seen
        self._absent: tuple[tuple[str, ...], list[str], int] | None = None  # see `_until`
        self._interrupt = wire.Interrupt()
        self.lease: JobLease | None = None
        """The launch's lease, attached to every key this client puts (`etcd_lease`)."""
        self.set_timeout(timeout)  # the base class keeps it: `self.timeout`, as on TCPStore
        self._clock = clock

    # ---- the Store interface ------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        full, raw, lease = self._key(key), wire.as_bytes(value), self._lease_id
        self._call(lambda c: c.put(full, raw, Lease(lease, c) if lease is not None else None))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [value for value in self._until(keys) if value is not None]

    def check(self, keys: list[str]) -> bool:
        return all(value is not None for value in self._read(keys, values=False)[0])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._until(keys, timeout, values=False)

    def get_within(self, key: str, timeout_s: float) -> bytes | None:
        """`key`'s value once it is put, or None after `timeout_s`: a read, or the watch that
        saw the put, whose event carries the value (no read after it: at N waiting nodes, N
        reads of the value fewer)."""
        try:
            return self._until([key], datetime.timedelta(seconds=timeout_s))[0]
        except WaitTimeoutError:
            return None

    def read_now(self, keys: list[str]) -> list[bytes | None]:
        """The keys' values now (None: absent), in one request, without waiting."""
        return self._read(keys)[0]

    def add_then_wait_on(self, key: str, watched: str) -> int:
        """`add(key, 1)`, looking at `watched` in the same request: where it is absent then,
        the next wait on it (`get_within`, `wait`) watches from that request's revision with
        no read first. A barrier node's arrival, before it waits for the round's close."""
        return self.add(key, 1, watched)

    def interrupt(self) -> None:
        """From another thread: the wait this client is in ends at once, raising
        `WatchInterruptedError`, as does any later request; the client is done."""
        self._interrupt.set()

    def add(self, key: str, amount: int, watched: str | None = None) -> int:
        full = self._key(key)
        look = [wire.range_op(self._key(watched), keys_only=True)] if watched else []
        kv = None if amount == 1 else wire.first_kv(self._txn([], [wire.range_op(full)], []))
        marker = self._markers.get(full, wire.marker(0))

        def recount(kv: dict[str, Any] | None) -> bytes | None:
            if kv is not None and (amount == 0 or (amount == 1 and wire.is_counter(kv))):
                return None  # a read (the barrier reads its counters so), or one put of `kv`'s
            return wire.marker(wire.number(kv) + amount - wire.version(kv) - 1)  # a counter now

        while True:
            if amount == 1:  # the arrival counter: one put that no other increment can undo
                once = wire.put_op(full, marker, prev_kv=True, lease=self._lease_id)
                reply = self._txn(
                    [wire.value_is(full, marker)], [once, *look], [wire.range_op(full), *look]
                )
                if watched and wire.value_of(reply["responses"][-1]) is None:
                    self._absent = ((watched,), [watched], wire.revision(reply))
                if reply.get("succeeded"):
                    self._markers[full] = marker
                    # One put later than the kv it replaced: the same marker, one version on.
                    return wire.count(reply["responses"][0]["response_put"]["prev_kv"]) + 1
                kv = wire.first_kv(reply)
            kv = self._swap(full, recount, kv)
            if amount == 1 and kv is not None and wire.is_counter(kv):
                marker = wire.raw(kv)  # another node made it a counter, or another offset: put it
                continue
            count = wire.number(kv) + amount
            if amount:
                self._markers[full] = wire.marker(count - wire.version(kv) - 1)
            return count

    def append(self, key: str, value: str | bytes) -> None:
        full = self._key(key)
        kv = wire.first_kv(self._txn([], [wire.range_op(full)], []))
        self._swap(
            full, lambda kv: (b"" if kv is None else wire.decoded(kv)) + wire.as_bytes(value), kv
        )

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected, desired = wire.as_bytes(expected), wire.as_bytes(desired)
        full = self._key(key)
        compare = wire.value_is(full, expected) if expected else wire.absent(full)
        put = wire.put_op(full, desired, lease=self._lease_id)
        reply = self._txn([compare], [put], [wire.range_op(full)])
        while not reply.get("succeeded"):
            kv = wire.first_kv(reply)
            if kv is None:
                return expected  # absent, expected set: TCPStore's
            current = wire.decoded(kv)
            if not expected or current != expected or not wire.is_counter(kv):
                return current
            # A counter whose count is `expected`: its value is the marker, so compare the
            # revision the count was read at instead.
            reply = self._txn([wire.mod_is(full, kv)], [put], [wire.range_op(full)])
        return desired

    def delete_key(self, key: str) -> bool:
        return bool(self._call(lambda c: c.delete(self._key(key))))

    def num_keys(self) -> int:
        return len(self._call(lambda c: c.get_prefix(self._prefix)))

    # ---- the launch's lease (`etcd_lease`) --------------------------------------------------

    def grant_lease(self, ttl_s: float) -> int:
        return self._call(lambda c: c.lease(int(ttl_s)).id)

    def revoke_lease(self, lease_id: int) -> None:
        self._call(lambda c: Lease(lease_id, c).revoke())

    @property
    def _lease_id(self) -> int | None:
        return self.lease.id if self.lease else None

    def _refresh_lease(self) -> None:
        """Keep the launch's lease alive, if this client's turn has come (`JobLease`)."""
        lease = self.lease
        if lease is None or not lease.take_refresh():
            return
        left = self._call(lambda c: Lease(lease.id, c).refresh())
        if left <= 0:  # no launcher refreshed it for a whole TTL: etcd deleted the job's keys
            raise DistStoreError(
                f"the job's etcd lease {lease.id} expired: its keys are gone (no launcher of "
                f"the job used the store for {lease.ttl_s:g}s)"
            )

    # ---- helpers ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _read(self, keys: list[str], values: bool = True) -> tuple[list[bytes | None], int]:
        """The keys' values (None: absent; b"" for present ones without `values`) and a store
        revision at which every absent one was absent (the lowest of the replies')."""
        if len(keys) > MAX_TXN_OPS:  # a closer reading every descriptor: one request, not N/128
            spanned = self._read_span(keys, values)
            if spanned is not None:
                return spanned
        found: list[bytes | None] = []
        revision = 0
        for start in range(0, len(keys), MAX_TXN_OPS):
            reads = [wire.range_op(self._key(k), keys_only=not values)
                     for k in keys[start : start + MAX_TXN_OPS]]  # fmt: skip
            reply = self._txn([], reads, [])
            found += [wire.value_of(response) for response in reply.get("responses", [])]
            revision = min(revision or wire.revision(reply), wire.revision(reply))
        return found, revision

    def _read_span(self, keys: list[str], values: bool) -> tuple[list[bytes | None], int] | None:
        """Many keys in one range read, from the lowest to just past the highest; None when the
        range holds more than as many other keys (then: transactions of `MAX_TXN_OPS` reads)."""
        full = [self._key(k).encode() for k in keys]
        read = {"key": wire.b64(min(full)), "range_end": wire.b64(max(full) + b"\0"),
                "limit": 2 * len(keys), "keys_only": not values}  # fmt: skip
        reply = self._txn([], [{"request_range": read}], [])
        answer = (reply.get("responses") or [{}])[0].get("response_range", {})
        if answer.get("more"):
            return None
        kvs = {base64.b64decode(kv["key"]): kv for kv in answer.get("kvs", [])}
        return [wire.decoded(kvs[k]) if k in kvs else None for k in full], wire.revision(reply)

    def _until(
        self, keys: list[str], timeout: datetime.timedelta | None = None, values: bool = True
    ) -> list[bytes | None]:
        """The keys' values once none is absent: a read, then a watch on the absent ones from
        the revision after that read (so no put is missed) until each has been put; then the
        values the watch's events carried where every key was absent, else a read again
        (without `values`, a `wait`: none, and no read after the watch). WaitTimeoutError
        after the timeout, as TCPStore."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = self._clock() + limit
        absent, self._absent = self._absent, None
        while True:
            if absent is not None and absent[0] == tuple(keys) and self._clock() < deadline:
                missing, revision = absent[1], absent[2]  # the last wait's: no read needed
            else:
                found, revision = self._read(keys, values)
                missing = [k for k, v in zip(keys, found, strict=True) if v is None]
                if not missing:
                    return found
            absent, seen = None, {}
            if self._clock() >= deadline or not self._watch(missing, revision + 1, deadline, seen):
                # A waiter that times out waits again soon (the barrier, in 1 s chunks): the
                # keys were absent at `revision`, and a watch from there replays any put since.
                self._absent = (tuple(keys), missing, revision)
                raise WaitTimeoutError(f"wait timeout after {limit:g}s for key(s) {missing}")
            if not values:
                return []
            full = [self._key(k).encode() for k in keys]
            if len(missing) == len(keys) and all(k in seen for k in full):
                # Each value as put at its event's revision, after this call began: what a
                # read at that moment returns (a read now could only be later).
                return [wire.decoded(seen[k]) for k in full]

    def _watch(self, keys: list[str], start: int, deadline: float, seen: dict[bytes, Any]) -> bool:
        """Block until each key has been put at `start` or later (True) or `deadline` (False):
        one watch on the range from the lowest key to just past the highest, through `_call`'s
        failover (a member lost mid-watch: the next one, from `start` again). `seen`: each
        put key's newest kv, from the events."""
        pending = {self._key(k).encode() for k in keys}
        create = {"key": wire.b64(min(pending)), "range_end": wire.b64(max(pending) + b"\0"),
                  "start_revision": start}  # fmt: skip
        answered = [self._clock()]  # a watch answers as it goes: `_call`'s timeout runs from then

        def request(member: Etcd3Client) -> bool:
            clocks = (self._clock, answered)
            return wire.watch_on(member, create, pending, clocks, deadline, seen, self._interrupt)

        return self._call(request, lambda: answered[0])

    def _swap(
        self,
        full: str,
        update: Callable[[dict[str, Any] | None], bytes | None],
        kv: dict[str, Any] | None,
    ) -> dict[str, Any] | None:
        """Replace the key, read as `kv` (None: absent), by `update(kv)` atomically (None: leave
        it): a transaction that compares the key's revision, retried while other writers change
        it first. Returns the key as it was when replaced."""
        pause = _POLL_S[0]
        while (new := update(kv)) is not None:
            compare = wire.mod_is(full, kv) if kv is not None else wire.absent(full)
            # On a lost race the failure branch returns the key as it is now: no second read.
            put = wire.put_op(full, new, lease=self._lease_id)
            reply = self._txn([compare], [put], [wire.range_op(full)])
            if reply.get("succeeded"):
                break
            kv = wire.first_kv(reply)
            time.sleep(random.uniform(0, pause))  # many nodes arriving at once: spread them
            pause = min(pause * 2, _POLL_S[1])
        return kv

    def _txn(self, compare: list[Any], success: list[Any], failure: list[Any]) -> dict[str, Any]:
        payload = {"compare": compare, "success": success, "failure": failure}
        return dict(self._call(lambda c: c.transaction(payload)))

    def _call(
        self, request: Callable[[Etcd3Client], T], answered: Callable[[], float] | None = None
    ) -> T:
        """`request` on the current member, else on the next ones, until one answers or none
        has for the store's timeout (each request is cut to the time left); `answered`: when
        a long request (a watch) last heard from its member, the timeout running from there."""
        self._refresh_lease()
        deadline = self._clock() + self.timeout.total_seconds()
        pause = _POLL_S[0]
        while True:
            first = self._current
            for step in range(len(self._members)):
                if answered is not None:
                    deadline = max(deadline, answered() + self.timeout.total_seconds())
                left = deadline - self._clock()
                if left <= 0:
                    break
                index = (first + step) % len(self._members)
                member = self._members[index]
                member.timeout = min(REQUEST_TIMEOUT_S, left)
                self._interrupt.check()
                try:
                    result = request(member)
                except _UNREACHABLE as exc:
                    if not exc.args:  # no answer at all; else a 503: electing a leader
                        self._member_down(index, exc)
                    continue
                except Etcd3Exception as exc:
                    if not wire.overloaded(exc):
                        raise _typed(exc, self._names[index]) from None
                    continue  # refused before it was proposed: safe to send again, later
                self._member_up(index)
                return result
            if self._clock() >= deadline:
                raise DistStoreError(
                    f"no etcd member answered for {self.timeout.total_seconds():g}s "
                    f"({', '.join(self._names)})"
                )
            # Jittered: the nodes an overloaded etcd refused at once must not come back at once.
            time.sleep(min(random.uniform(pause / 2, pause), max(deadline - self._clock(), 0.0)))
            pause = min(pause * 2, 1.0)

    def _member_down(self, index: int, exc: Exception) -> None:
        self.health.mark_down(self._names[index], exc)
        self._current = self.health.first_answering(self._names, index + 1)

    def _member_up(self, index: int) -> None:
        self._current = index
        self.health.mark_up(self._names[index])


def _typed(exc: Etcd3Exception, member: str) -> DistStoreError:
    text = f"{exc.detail_text or exc}".strip().splitlines()[0] if exc.detail_text else str(exc)
    if any(word in text.lower() for word in ("auth", "permission", "user name")):
        return EtcdAuthError(f"etcd at {member} refused: {text}")
    return DistStoreError(f"etcd at {member}: {text}")
