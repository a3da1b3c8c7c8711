"""etcd's v3 JSON gateway as `EtcdStore` speaks it: request bodies, reading keys back, the
counter marker, and the watch stream (a streamed POST to `/v3/watch`, read in the caller's
thread: etcd3gw's own watcher runs a thread and cannot be bounded by a deadline).

The gateway sends int64 values as JSON strings, leaves out zero and false fields, and base64s
keys and values.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception
from torch.distributed import DistStoreError

COUNTER = b"\x00ftrun-count-is-version+"
"""A counter key's value is this and an offset: its count is the key's version + the offset."""
BUSY = (408, 503, 504)
"""HTTP answers of a member saying "not now" (etcd3gw maps them to `_UNREACHABLE`)."""


def overloaded(exc: Etcd3Exception) -> bool:
    """etcd's backpressure: a member whose applied index lags its committed one by more than
    5,000 entries refuses new proposals ("etcdserver: too many requests", before proposing
    them, so a retry cannot apply one twice). Seen with 16,384 nodes arriving at once; the
    store sends the request again after its back-off, as a busy member's."""
    return "too many requests" in f"{exc.detail_text or ''} {exc}".lower()


class WatchInterruptedError(DistStoreError):
    """A wait ended by `Interrupt.set` from another thread (a message without "timeout": not
    taken for a wait that ran out)."""


class Interrupt:
    """Ends a client's watch in progress from another thread: the watch's socket is shut down,
    so that its blocked read returns at once, and no later request of the client is sent. A
    thread that waits in long watches is then stopped without waiting out its watch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.is_set = False

    def set(self) -> None:
        with self._lock:
            self.is_set = True
            held = list(self._sockets)
        for sock in held:
            with contextlib.suppress(OSError):  # closed meanwhile: its read has returned
                sock.shutdown(socket.SHUT_RDWR)

    def hold(self, sock: socket.socket | None) -> None:
        """`sock` is read until `release` (None: nothing to shut down); raises if interrupted
        already."""
        with self._lock:
            self.check()
            if sock is not None:
                self._sockets.add(sock)

    def release(self, sock: socket.socket | None) -> None:
        if sock is not None:
            with self._lock:
                self._sockets.discard(sock)

    def check(self) -> None:
        if self.is_set:
            raise WatchInterruptedError("the wait was interrupted")


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def as_bytes(value: str | bytes | int) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def put_op(
    key: str, value: bytes, prev_kv: bool = False, lease: int | None = None
) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if prev_kv:  # the key as it was: a counter's count is its version after this put
        put["prev_kv"] = True
    if lease is not None:  # the key goes when the lease does (`etcd_lease`)
        put["lease"] = lease
    return {"request_put": put}


def range_op(key: str, keys_only: bool = False) -> dict[str, Any]:
    """A read of one key; `keys_only`: whether it exists, without its value."""
    read: dict[str, Any] = {"key": b64(key)}
    if keys_only:
        read["keys_only"] = True
    return {"request_range": read}


def value_is(key: str, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def mod_is(key: str, kv: dict[str, Any]) -> dict[str, Any]:
    """The key is as `kv` found it: its mod revision has not moved."""
    return {"key": b64(key), "target": "MOD", "result": "EQUAL",
            "mod_revision": int(kv.get("mod_revision", 0))}  # fmt: skip


def absent(key: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}


def marker(offset: int) -> bytes:
    return COUNTER + str(offset).encode()


def raw(kv: dict[str, Any]) -> bytes:
    """The value as stored (the JSON gateway leaves out an empty one)."""
    return base64.b64decode(kv.get("value", ""))


def is_counter(kv: dict[str, Any]) -> bool:
    return raw(kv).startswith(COUNTER)


def number(kv: dict[str, Any] | None) -> int:
    """What `add` adds to: 0 for an absent key."""
    return 0 if kv is None else int(decoded(kv))


def version(kv: dict[str, Any] | None) -> int:
    """Puts since the key was created (an int64: a JSON string); 0 for an absent key."""
    return 0 if kv is None else int(kv.get("version", 0))


def count(kv: dict[str, Any]) -> int:
    """A counter's count: its version plus the marker's offset."""
    return version(kv) + int(raw(kv)[len(COUNTER) :])


def decoded(kv: dict[str, Any]) -> bytes:
    """The value a reader sees: a counter's count, as TCPStore keeps it, else the value."""
    return str(count(kv)).encode() if is_counter(kv) else raw(kv)


def value_of(response: dict[str, Any]) -> bytes | None:
    kvs = response.get("response_range", {}).get("kvs")
    return decoded(kvs[0]) if kvs else None


def revision(reply: dict[str, Any]) -> int:
    """The store's revision when it answered (an int64: a JSON string)."""
    return int(reply.get("header", {}).get("revision", 0))


def first_kv(reply: dict[str, Any]) -> dict[str, Any] | None:
    """The key in the reply's first range response (None: absent)."""
    responses = reply.get("responses") or [{}]
    kvs = responses[0].get("response_range", {}).get("kvs")
    return kvs[0] if kvs else None


def watch_on(
    member: Etcd3Client,
    create: dict[str, Any],
    pending: set[bytes],
    clocks: tuple[Callable[[], float], list[float]],
    deadline: float,
    seen: dict[bytes, Any],
    interrupt: Interrupt,
) -> bool:
    """One watch on one member (etcd's `/v3/watch`, a stream of JSON lines), read in this
    thread and closed before returning: True once every key of `pending` has been put (its kv
    in `seen`), False at `deadline`. A member that fails raises as etcd3gw would, for `_call`
    to go on; each message from it is written down in `clocks[1]` (`clocks[0]`: the store's
    clock). `interrupt` set: raises WatchInterruptedError."""
    clock = clocks[0]
    left = min(member.timeout, deadline - clock())  # `_call` cut it to the time it has left
    if left <= 0:
        return False
    try:
        # "hasleader": a member cut off from the leader ends the watch instead of staying mute.
        answer = member.session.post(
            member.get_url("/watch"), json={"create_request": create}, stream=True,
            timeout=(left, left), headers={"Grpc-Metadata-hasleader": "true"},
        )  # fmt: skip
    except requests.Timeout:
        raise ConnectionTimeoutError() from None
    except requests.ConnectionError:
        raise ConnectionFailedError() from None
    with answer:
        if answer.status_code != 200:
            exc = ConnectionTimeoutError if answer.status_code in BUSY else Etcd3Exception
            raise exc(answer.text, answer.reason)
        sock = getattr(answer.raw.connection, "sock", None)  # None: answered and closed
        interrupt.hold(sock)
        try:
            return watch_events(answer, pending, clocks, deadline, seen, interrupt)
        finally:
            interrupt.release(sock)


def watch_events(
    answer: requests.Response,
    pending: set[bytes],
    clocks: tuple[Callable[[], float], list[float]],
    deadline: float,
    seen: dict[bytes, Any],
    interrupt: Interrupt,
) -> bool:
    clock, answered = clocks
    buffer = b""
    chunks = answer.iter_content(chunk_size=None)
    while pending:
        left = deadline - clock()
        if left <= 0:
            return False
        sock = getattr(answer.raw.connection, "sock", None)
        if sock is not None:  # each read waits for the time left, not the time at the start
            sock.settimeout(left)
        try:
            buffer += next(chunks)
        except (requests.RequestException, StopIteration, OSError):
            interrupt.check()  # the socket was shut down on purpose: no member went away
            if clock() >= deadline:
                return False
            answered[0] = clock()  # it held the watch until now: the next member's time from here
            raise ConnectionFailedError() from None  # the member went away mid-watch
        answered[0] = clock()
        *lines, buffer = buffer.split(b"\n")
        for line in filter(None, (raw.strip() for raw in lines)):
            message = json.loads(line)
            result = message.get("result")
            if result is None:  # {"error": ...}: no leader (503: "not now", as `_call` takes
                error = message.get("error") or {}  # it), or a member that is stopping
                if int(error.get("http_code", 0)) in BUSY:
                    raise ConnectionTimeoutError(str(error), str(error.get("message")))
                raise ConnectionFailedError()
            if result.get("canceled"):  # `start` compacted away: read again, watch from now
                return True
            for event in result.get("events", []):
                if event.get("type", "PUT") == "PUT":  # the gateway leaves out PUT (0)
                    key = base64.b64decode(event["kv"]["key"])
                    pending.discard(key)
                    seen[key] = event["kv"]
    return True
