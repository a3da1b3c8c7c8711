"""torch's `Store` interface on etcd (`--rdzv-backend=etcd`): the store off the training nodes.

With TCPStore, the first agent hosts the job's store and the job ends with that node. etcd is
Raft-replicated: losing any training node, or any etcd member short of a majority, leaves the
store standing. This class speaks etcd's v3 JSON gateway through `etcd3gw` (no grpc stubs) and
keeps TCPStore's semantics, which the rendezvous, job control and the subsystems rely on, so
that nothing above `rendezvous/store.py` knows which backend it has:

- `get`, `multi_get` and `wait` block until their keys exist, up to the store's timeout;
- `add`, `append` and `compare_set` are atomic: one transaction comparing the key's revision
  (or its value), retried when another writer got there first;
- `compare_set` of an absent key with `expected == b""` creates it (TCPStore's rule).

Every key goes under `/ftrun/<run id>/`, so several jobs share one etcd. Endpoints are tried in
turn: a member that stops answering is left for the next one, with one log line, and a request
fails only when no member has answered for the whole timeout.
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
from torch.distributed import DistStoreError, Store

log = logging.getLogger("ftrun.rendezvous")

REQUEST_TIMEOUT_S = 5.0
"""One HTTP request to one member; a member slower than this is skipped for the next."""
MAX_TXN_OPS = 128
"""etcd's default `--max-txn-ops`: a transaction with more operations is refused."""
_POLL_S = (0.005, 0.2)
"""First and longest pause between two looks at keys that do not exist yet."""
_UNREACHABLE = (ConnectionFailedError, ConnectionTimeoutError)
"""No answer (etcd3gw raises them without args), or an answer saying "not now": 503 while the
members elect a leader, 408/504 (with the HTTP reason as their argument)."""
T = TypeVar("T")


class EtcdAuthError(DistStoreError):
    """etcd refused the request (authentication or permission)."""


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _bytes(value: str | bytes | int) -> bytes:
    if isinstance(value, bytes):
        return value
    return str(value).encode()


class EtcdStore(Store):
    """A TCPStore stand-in on an etcd cluster, for one job (`run_id`)."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        run_id: str,
        timeout: datetime.timedelta,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._members = [Etcd3Client(host, port, timeout=REQUEST_TIMEOUT_S, api_path="/v3/")
                         for host, port in endpoints]  # fmt: skip
        self._names = [f"{host}:{port}" for host, port in endpoints]
        self._current = 0
        self._down: set[int] = set()
        self._prefix = f"/ftrun/{run_id}/"
        self.set_timeout(timeout)  # the base class keeps it: `self.timeout`, as on TCPStore
        self._clock = clock

    # ---- the Store interface ------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._call(lambda c: c.put(self._key(key), _bytes(value)))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._until(lambda: self._values(keys), keys)
        return [value for value in found if value is not None]

    def check(self, keys: list[str]) -> bool:
        return all(value is not None for value in self._values(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._until(lambda: self._values(keys), keys, timeout)

    def add(self, key: str, amount: int) -> int:
        if amount == 0:  # the barrier reads its counters so: a read, not a contended write
            current = self._values([key])[0]
            if current is not None:
                return int(current)

        def update(current: bytes | None) -> bytes:
            return str(int(current or b"0") + amount).encode()

        return int(self._swap(key, update))

    def append(self, key: str, value: str | bytes) -> None:
        self._swap(key, lambda current: (current or b"") + _bytes(value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected, desired = _bytes(expected), _bytes(desired)
        full = self._key(key)
        if expected:
            compare = {"key": _b64(full), "target": "VALUE", "result": "EQUAL",
                       "value": _b64(expected)}  # fmt: skip
        else:
            compare = {"key": _b64(full), "target": "CREATE", "result": "EQUAL",
                       "create_revision": 0}  # fmt: skip
        reply = self._txn([compare], [_put(full, desired)], [_range(full)])
        if reply.get("succeeded"):
            return desired
        current = _first_value(reply)
        return expected if current is None else current  # absent, expected set: TCPStore's

    def delete_key(self, key: str) -> bool:
        reply = self._call(lambda c: c.delete(self._key(key)))
        return bool(reply)

    def num_keys(self) -> int:
        reply = self._call(lambda c: c.get_prefix(self._prefix))
        return len(reply)

    # ---- helpers ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _values(self, keys: list[str]) -> list[bytes | None]:
        """The keys' values (None: absent), in transactions of at most `MAX_TXN_OPS` reads."""
        found: list[bytes | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            reads = [_range(self._key(k)) for k in keys[start : start + MAX_TXN_OPS]]
            reply = self._txn([], reads, [])
            found += [_value_of(response) for response in reply.get("responses", [])]
        return found

    def _until(
        self,
        look: Callable[[], list[bytes | None]],
        keys: list[str],
        timeout: datetime.timedelta | None = None,
    ) -> list[bytes | None]:
        """`look()` until no value is None; DistStoreError after the timeout, as TCPStore."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = self._clock() + limit
        pause = _POLL_S[0]
        while True:
            found = look()
            if all(value is not None for value in found):
                return found
            if self._clock() >= deadline:
                missing = [k for k, v in zip(keys, found, strict=True) if v is None]
                raise DistStoreError(f"wait timeout after {limit:g}s for key(s) {missing}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    def _swap(self, key: str, update: Callable[[bytes | None], bytes]) -> bytes:
        """Replace the key's value by `update(value)` atomically: a transaction that compares
        the key's revision, retried while other writers change it first."""
        full = self._key(key)
        reply = self._txn([], [_range(full)], [])
        pause = _POLL_S[0]
        while True:
            current, revision = _first_value(reply), _first_revision(reply)
            new = update(current)
            compare = {"key": _b64(full), "target": "MOD", "result": "EQUAL",
                       "mod_revision": revision}  # fmt: skip
            # On a lost race the failure branch returns the key as it is now: no second read.
            reply = self._txn([compare], [_put(full, new)], [_range(full)])
            if reply.get("succeeded"):
                return new
            time.sleep(random.uniform(0, pause))  # many nodes arriving at once: spread them
            pause = min(pause * 2, _POLL_S[1])

    def _txn(self, compare: list[Any], success: list[Any], failure: list[Any]) -> dict[str, Any]:
        payload = {"compare": compare, "success": success, "failure": failure}
        return dict(self._call(lambda c: c.transaction(payload)))

    def _call(self, request: Callable[[Etcd3Client], T]) -> T:
        """`request` on the current member, else on the next ones, until one answers or none
        has for the store's timeout (each request is cut to the time left)."""
        deadline = self._clock() + self.timeout.total_seconds()
        pause = _POLL_S[0]
        while True:
            first = self._current
            for step in range(len(self._members)):
                left = deadline - self._clock()
                if left <= 0:
                    break
                index = (first + step) % len(self._members)
                member = self._members[index]
                member.timeout = min(REQUEST_TIMEOUT_S, left)
                try:
                    result = request(member)
                except _UNREACHABLE as exc:
                    if not exc.args:  # no answer at all; else a 503: electing a leader
                        self._member_down(index, exc)
                    continue
                except Etcd3Exception as exc:
                    raise _typed(exc, self._names[index]) from None
                self._member_up(index)
                return result
            if self._clock() >= deadline:
                raise DistStoreError(
                    f"no etcd member answered for {self.timeout.total_seconds():g}s "
                    f"({', '.join(self._names)})"
                )
            time.sleep(min(pause, max(deadline - self._clock(), 0.0)))
            pause = min(pause * 2, 1.0)

    def _member_down(self, index: int, exc: Exception) -> None:
        if index not in self._down:
            self._down.add(index)
            log.warning("etcd member %s does not answer (%s); using the others",
                        self._names[index], type(exc).__name__)  # fmt: skip
        self._current = (index + 1) % len(self._members)

    def _member_up(self, index: int) -> None:
        self._current = index
        if index in self._down:
            self._down.discard(index)
            log.info("etcd member %s answers again", self._names[index])


def _put(key: str, value: bytes) -> dict[str, Any]:
    return {"request_put": {"key": _b64(key), "value": _b64(value)}}


def _range(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def _value_of(response: dict[str, Any]) -> bytes | None:
    kvs = response.get("response_range", {}).get("kvs")
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def _first_value(reply: dict[str, Any]) -> bytes | None:
    responses = reply.get("responses") or [{}]
    return _value_of(responses[0])


def _first_revision(reply: dict[str, Any]) -> int:
    """The key's mod revision in the reply's first range response (0: absent)."""
    responses = reply.get("responses") or [{}]
    kvs = responses[0].get("response_range", {}).get("kvs")
    return int(kvs[0].get("mod_revision", 0)) if kvs else 0


def _typed(exc: Etcd3Exception, member: str) -> DistStoreError:
    text = f"{exc.detail_text or exc}".strip().splitlines()[0] if exc.detail_text else str(exc)
    if any(word in text.lower() for word in ("auth", "permission", "user name")):
        return EtcdAuthError(f"etcd at {member} refused: {text}")
    return DistStoreError(f"etcd at {member}: {text}")
