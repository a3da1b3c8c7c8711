"""PeerServer: an agent's end of the peer channel, serving the request kinds registered on it.

One accept thread, one thread per connection (at most `max_connections`; more are refused with
a warning). A connection starts with the handshake (`auth`), then carries one request at a
time: a request frame with its bulk bytes after it, the kind's handler, one reply frame
(`reply`, or `error` with the handler's exception, after which the connection goes on).
A connection that breaks the protocol (bad frame, unknown kind, refused handshake, a peer that
stalls mid-frame for `io_timeout`) is closed and logged once at WARNING with the peer's
address; the others are served on. An idle connection is closed after `idle_timeout`.
`close()` stops the accept thread, shuts every connection down and joins every thread
(bounded: a handler that never returns is reported, not waited for).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias

from ftrun.peer.auth import check_secret, server_handshake
from ftrun.peer.protocol import (
    Buffer,
    Chunk,
    Frame,
    Payload,
    PeerError,
    PeerProtocolError,
    PeerTimeoutError,
    Stream,
    address,
    as_chunks,
    byte_view,
    deadline_budget,
    release_views,
    request_kind,
)

log = logging.getLogger("ftrun.peer")

_MAX_ERROR_LEN = 1000
_ACCEPT_BACKOFF_S = 0.5


class Request:
    """One incoming request: the kind's fields, and `nbytes` bulk bytes for the handler to read.

    Bulk bytes the handler leaves unread are read and dropped before the reply is sent.
    """

    def __init__(self, frame: Frame, peer: str, stream: Stream) -> None:
        self.kind = frame.kind
        self.header = frame.header
        self.nbytes = frame.nbytes
        self.peer = peer
        self.remaining = frame.nbytes
        self._stream = stream
        self.broken: PeerError | None = None

    def read_into(self, dest: Buffer) -> None:
        """Fill the writable `dest` with the next `len(dest)` bulk bytes (no copy in between);
        several calls may scatter the bulk into several buffers."""
        view = byte_view(dest, writable=True)
        try:
            if view.nbytes > self.remaining:
                raise ValueError(f"{view.nbytes} bytes asked, {self.remaining} left")
            self._stream.recv_into(view)
            self.remaining -= view.nbytes
        except PeerError as exc:
            self.broken = exc
            raise
        finally:
            view.release()

    def read(self) -> bytearray:
        """The rest of the bulk bytes, in a new buffer."""
        buffer = bytearray(self.remaining)
        self.read_into(buffer)
        return buffer


class Reply(NamedTuple):
    """A handler's answer: a small header and, optionally, bulk bytes sent without a copy."""

    header: Mapping[str, Any] | None = None
    payload: Payload = None
    """A buffer, a `FileRegion`, or a list of them; it must not change until `release`."""
    release: Callable[[], None] | None = None
    """Called once the payload has been sent (or the send failed)."""


Handler: TypeAlias = Callable[[Request], "Reply | Mapping[str, Any] | None"]


class PeerServer:
    """Serves `register`ed kinds to the agents of job `job_id` on `host`, port picked by the OS."""

    def __init__(
        self, host: str, secret: bytes, job_id: str, *, port: int = 0, max_connections: int = 64,
        handshake_timeout: float = 10.0, io_timeout: float = 60.0, idle_timeout: float = 600.0,
    ) -> None:  # fmt: skip
        self._secret = check_secret(secret)
        self._job_id = job_id
        self._max_connections = max_connections
        self._handshake_timeout = handshake_timeout
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._handlers: dict[str, Handler] = {}
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closing = False
        self._accepter = threading.Thread(target=self._accept_loop, name="ftrun-peer-accept",
                                          daemon=True)  # fmt: skip

    def register(self, kind: str, handler: Handler) -> None:
        """Serve requests of `kind` with `handler` (called on the connection's thread)."""
        if request_kind(kind) in self._handlers:
            raise ValueError(f"request kind {kind!r} is already registered")
        self._handlers[kind] = handler

    @property
    def open_connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._connections)

    def start(self) -> PeerServer:
        self._accepter.start()
        log.info("peer channel serving on %s:%d", self.host, self.port)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, shut every connection down, join every thread (within `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closing:
                return
            self._closing = True
            threads = list(self._connections.values())
            for sock in self._connections:
                _shutdown(sock)  # under the lock: its thread closes it under the lock too
        self._wake_w.send(b"x")
        if self._accepter.is_alive():
            self._accepter.join(max(0.0, deadline - time.monotonic()))
            threads.append(self._accepter)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            log.warning("peer channel: %s still running %gs after close", stuck, timeout)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- accepting ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            poller.poll()
            if self._closing:
                return
            try:
                sock, client = self._listener.accept()
            except BlockingIOError:  # it went away before we took it
                continue
            except OSError as exc:  # out of file descriptors: back off rather than spin
                log.warning("peer channel: cannot accept a connection: %s", exc)
                select.select([self._wake_r], [], [], _ACCEPT_BACKOFF_S)
                continue
            self._admit(sock, address(*client[:2]))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        with self._lock:
            full = len(self._connections) >= self._max_connections
            if not (full or self._closing):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(sock, peer),
                                          name=f"ftrun-peer-conn {peer}", daemon=True)  # fmt: skip
                self._connections[sock] = thread
                thread.start()
                return
        sock.close()
        if full:
            log.warning("peer channel: refused %s: %d connections open already", peer,
                        self._max_connections)  # fmt: skip

    # ---- one connection ----------------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: str) -> None:
        stream = Stream(sock, peer, deadline_budget(self._handshake_timeout, "timed out"))
        try:
            try:
                server_handshake(stream, self._secret, self._job_id)
            except PeerTimeoutError:
                bound = self._handshake_timeout
                raise PeerTimeoutError(f"no handshake within {bound:g}s") from None
            stream.budget = lambda: self._io_timeout
            while not self._closing and stream.readable(self._idle_timeout):
                frame = stream.recv()
                if frame is None:
                    break
                self._handle(stream, frame)
        except PeerError as exc:
            if not self._closing:
                log.warning("peer channel: closed the connection from %s: %s", peer, exc)
        except Exception as exc:  # a bug here must not take the thread down unseen
            log.warning("peer channel: connection from %s failed: %r", peer, exc, exc_info=True)
        finally:
            with self._lock:
                del self._connections[sock]
                sock.close()

    def _handle(self, stream: Stream, frame: Frame) -> None:
        handler = self._handlers.get(frame.kind)
        if handler is None:
            error = f"unknown request kind {frame.kind!r}"
            with contextlib.suppress(PeerError):
                stream.send("error", {"error": error})
            raise PeerProtocolError(error)
        request = Request(frame, stream.peer, stream)
        try:
            reply = _as_reply(handler(request))
        except Exception as exc:
            if request.broken is not None:
                raise request.broken from None
            self._fail(stream, request, exc)
            return
        try:
            if request.remaining:
                stream.drain(request.remaining)
            chunks: list[Chunk] = []
            try:
                # A bad payload or a header that is not JSON raises before anything is sent.
                chunks = as_chunks(reply.payload)
                stream.send("reply", dict(reply.header or {}), chunks)
            except (TypeError, ValueError) as exc:
                self._fail(stream, request, exc)
            finally:
                release_views(chunks)
        finally:
            if reply.release is not None:
                reply.release()

    def _fail(self, stream: Stream, request: Request, exc: Exception) -> None:
        """Tell the client why its request failed; the connection goes on."""
        text = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_LEN]
        log.warning("peer channel: %r request from %s failed: %s", request.kind, request.peer, text)
        if request.remaining:
            stream.drain(request.remaining)
        stream.send("error", {"error": text})


def _as_reply(result: Reply | Mapping[str, Any] | None) -> Reply:
    if isinstance(result, Reply):
        return result
    if result is None or isinstance(result, Mapping):
        return Reply(result)
    raise TypeError(f"a handler returns a Reply, a header mapping or None, not {type(result)}")


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
