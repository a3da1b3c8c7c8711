"""PeerClient: requests to other agents' `PeerServer`s, small or bulk, each within its timeout.

A call connects (or reuses an idle connection to the same peer), proves membership of the job
(`auth`), sends one request frame with its bulk bytes, and reads one reply. `timeout` bounds the
whole call, connecting and every byte included: a dead or silent peer costs a `PeerError`
(`PeerTimeoutError`) within it, never a hang. A connection that failed in any way is closed;
one that answered (even with the peer handler's error) goes back to the pool. Thread-safe:
concurrent calls use separate connections.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ftrun.peer.auth import check_secret, client_handshake
from ftrun.peer.protocol import (
    Buffer,
    Frame,
    Payload,
    PeerError,
    PeerProtocolError,
    PeerRemoteError,
    PeerTimeoutError,
    Stream,
    address,
    as_chunks,
    byte_view,
    deadline_budget,
    release_views,
    request_kind,
)

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0


class PeerClient:
    """Talks to the peer servers of job `job_id`, proving itself with the job's `secret`."""

    def __init__(self, secret: bytes, job_id: str, *, max_idle_per_peer: int = 4,
                 idle_ttl: float = 30.0) -> None:  # fmt: skip
        self._secret = check_secret(secret)
        self._job_id = job_id
        self._max_idle = max_idle_per_peer
        self._idle_ttl = idle_ttl
        """Below the server's idle timeout, so a pooled connection is not closed under us."""
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[Stream, float]]] = {}
        self._closed = False

    def request(
        self, host: str, port: int, kind: str, header: Mapping[str, Any] | None = None,
        payload: Payload = None, timeout: float = DEFAULT_TIMEOUT_S,
    ) -> tuple[dict[str, Any], bytearray | None]:  # fmt: skip
        """Send a request (with optional bulk bytes); the reply's header and bulk bytes."""

        def receive(stream: Stream, frame: Frame) -> bytearray | None:
            if not frame.nbytes:
                return None
            buffer = bytearray(frame.nbytes)
            stream.recv_into(memoryview(buffer))
            return buffer

        return self._call(host, port, kind, header, payload, timeout, receive)

    def fetch_into(
        self, host: str, port: int, kind: str, header: Mapping[str, Any] | None, dest: Buffer,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> dict[str, Any]:  # fmt: skip
        """Ask for bulk bytes and receive exactly `len(dest)` of them straight into `dest`."""
        view = byte_view(dest, writable=True)

        def receive(stream: Stream, frame: Frame) -> None:
            if frame.nbytes != view.nbytes:
                raise PeerProtocolError(f"{stream.peer} replied with {frame.nbytes} bulk bytes, "
                                        f"{view.nbytes} were expected")  # fmt: skip
            stream.recv_into(view)

        try:
            return self._call(host, port, kind, header, None, timeout, receive)[0]
        finally:
            view.release()

    def push(
        self, host: str, port: int, kind: str, header: Mapping[str, Any] | None,
        payload: Payload, timeout: float = DEFAULT_TIMEOUT_S,
    ) -> dict[str, Any]:  # fmt: skip
        """Send bulk bytes (buffers or `FileRegion`s, not copied); the reply's header."""

        def receive(stream: Stream, frame: Frame) -> None:
            if frame.nbytes:
                raise PeerProtocolError(f"{stream.peer} replied to a push with bulk bytes")

        return self._call(host, port, kind, header, payload, timeout, receive)[0]

    def close(self) -> None:
        """Close the idle connections; calls in progress close theirs when they end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for streams in idle.values():
            for stream, _ in streams:
                stream.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- one call ------------------------------------------------------------------------------

    def _call(
        self, host: str, port: int, kind: str, header: Mapping[str, Any] | None,
        payload: Payload, timeout: float, receive: Callable[[Stream, Frame], T],
    ) -> tuple[dict[str, Any], T]:  # fmt: skip
        request_kind(kind)
        peer = address(host, port)
        budget = deadline_budget(timeout, f"{peer} did not answer within {timeout:g}s")
        chunks = as_chunks(payload)
        stream: Stream | None = None
        reusable = False
        try:
            stream = self._checkout(host, port, peer, budget)
            stream.send(kind, dict(header or {}), chunks)
            frame = stream.recv()
            if frame is None:
                raise PeerError(f"{peer} closed the connection without replying to {kind!r}")
            if frame.kind == "error":
                stream.drain(frame.nbytes)
                reusable = True
                error = frame.header.get("error")
                raise PeerRemoteError(f"{peer} failed to serve {kind!r}: {str(error)[:1000]}")
            if frame.kind != "reply":
                raise PeerProtocolError(f"{peer} answered {kind!r} with {frame.kind[:64]!r}")
            result = receive(stream, frame)
            reusable = True
            return frame.header, result
        finally:
            release_views(chunks)
            if stream is not None and reusable:
                self._checkin((host, port), stream)
            elif stream is not None:
                stream.close()

    def _checkout(self, host: str, port: int, peer: str, budget: Callable[[], float]) -> Stream:
        """An idle connection to the peer that is still open, else a new one (handshaken)."""
        stale: list[Stream] = []
        found: Stream | None = None
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise PeerError("the peer client is closed")
            idle = self._idle.get((host, port), [])
            while idle and found is None:
                stream, since = idle.pop()
                # Readable while idle: the peer closed it (or broke the protocol).
                if now - since > self._idle_ttl or stream.readable(0):
                    stale.append(stream)
                else:
                    found = stream
        for stream in stale:
            stream.close()
        if found is not None:
            found.budget = budget
            return found
        try:
            sock = socket.create_connection((host, port), timeout=budget())
        except TimeoutError:
            raise PeerTimeoutError(f"cannot connect to {peer}: timed out") from None
        except OSError as exc:
            raise PeerError(f"cannot connect to {peer}: {exc.strerror or exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = Stream(sock, peer, budget)
        try:
            client_handshake(stream, self._secret, self._job_id)
        except BaseException:
            stream.close()
            raise
        return stream

    def _checkin(self, key: tuple[str, int], stream: Stream) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append((stream, time.monotonic()))
                return
        stream.close()
