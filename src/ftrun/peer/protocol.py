"""The peer channel's wire format: frames, their validation, and bounded socket I/O.

A frame is `MAGIC` (4 bytes), the header's length (u32, big-endian, at most
`MAX_HEADER_BYTES`), the header, then `n` bulk bytes. The header is a JSON object with exactly
three keys: `k` (the message kind), `n` (the bulk byte count that follows) and `h` (the kind's
own fields, a JSON object). Nothing is ever unpickled. A connection carries the handshake
(`auth`: hello, challenge, auth, welcome or reject), then requests of the kinds the server
registered, each answered by one `reply` (or `error`) frame. The framing stays the same in
every protocol version, so that peers of different versions can still refuse each other with a
message saying why; everything above it is `PROTOCOL_VERSION`, checked in the handshake.

Every blocking socket call of a `Stream` waits at most `budget()` seconds: a constant per call on
the server, the time left to the caller's deadline on the client. Bulk bytes are sent from the
caller's buffers (`sendall` on memoryview slices, `os.sendfile` for a `FileRegion`) and received
straight into the caller's writable buffer (`recv_into`).
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

from ftrun import untrusted_json
from ftrun.errors import FtrunError

PROTOCOL_VERSION = 1
MAGIC = b"FTRP"
PREFIX = struct.Struct(">4sI")
MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 1 << 44
"""16 TiB: a sanity bound on `n`; receivers check it against what they expect."""
MAX_KIND_LEN = 64
RESERVED_KINDS = frozenset({"hello", "challenge", "auth", "welcome", "reject", "reply", "error"})
"""The handshake's kinds, then a request's answers: no request may have them."""

_CHUNK = 64 << 20  # bytes per send call: each waits at most one budget
_INLINE = 16 << 10  # small payloads travel in the header's own send


class PeerError(FtrunError):
    """A peer request failed: unreachable, rejected, timed out, closed, or broke the protocol."""


class PeerTimeoutError(PeerError):
    """The peer did not answer (or take our bytes) within the timeout."""


class PeerProtocolError(PeerError):
    """A frame is malformed, oversized, of an unknown kind or unexpected at this point."""


class PeerHandshakeError(PeerError):
    """The connection was refused: protocol version, job or job secret differ."""


class PeerRemoteError(PeerError):
    """The peer's handler failed; the message is the peer's. The connection stays usable."""


class FileRegion(NamedTuple):
    """`nbytes` bytes of an open file from `offset`, sent with `os.sendfile` (no user copy)."""

    fd: int
    offset: int
    nbytes: int


Buffer: TypeAlias = Any  # anything with the buffer protocol: bytes, memoryview, mmap, ndarray
Chunk: TypeAlias = "memoryview | FileRegion"
Payload: TypeAlias = "Buffer | FileRegion | Sequence[Buffer | FileRegion] | None"


class Frame(NamedTuple):
    """A validated frame header; `nbytes` bulk bytes follow it on the stream."""

    kind: str
    nbytes: int
    header: dict[str, Any]


def byte_view(buffer: Buffer, writable: bool = False) -> memoryview:
    """A flat byte view of a contiguous buffer (ValueError if it is not one).

    Release it (`release_views`) when done, even on error: a view left in a traceback keeps
    an mmap from closing (BufferError) for as long as the exception lives.
    """
    view = memoryview(buffer)
    if writable and view.readonly:
        raise ValueError("the destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("bulk buffers must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def as_chunks(payload: Payload) -> list[Chunk]:
    """The payload as a list of byte views and file regions."""
    if payload is None:
        return []
    if isinstance(payload, FileRegion):
        return [payload]
    if isinstance(payload, (list, tuple)):
        return [p if isinstance(p, FileRegion) else byte_view(p) for p in payload]
    return [byte_view(payload)]


def release_views(chunks: Sequence[Chunk]) -> None:
    for chunk in chunks:
        if isinstance(chunk, memoryview):
            chunk.release()


def request_kind(kind: object) -> str:
    """`kind` if a request may have it (ValueError if not): a client's or a handler's."""
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_LEN:
        raise ValueError(f"a request kind is a string of 1 to {MAX_KIND_LEN} characters")
    if kind in RESERVED_KINDS:
        raise ValueError(f"request kind {kind!r} is reserved")
    return kind


def address(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets: how logs and errors name a peer."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def deadline_budget(timeout: float, message: str) -> Callable[[], float]:
    """A `Stream` budget: the time left to a deadline `timeout` from now; PeerTimeoutError
    (`message`) once past."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerTimeoutError(message)
        return remaining

    return left


def parse_header(raw: bytes) -> Frame:
    """Decode and validate one header; anything unexpected raises `PeerProtocolError`."""
    try:
        fields = untrusted_json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one
        raise PeerProtocolError("the header is not JSON (or nested too deeply)") from None
    if not isinstance(fields, dict) or fields.keys() != {"k", "n", "h"}:
        raise PeerProtocolError("the header is not a {k, n, h} object")
    kind, nbytes, header = fields["k"], fields["n"], fields["h"]
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_LEN:
        raise PeerProtocolError(f"message kind must be a string of 1 to {MAX_KIND_LEN} characters")
    if type(nbytes) is not int or not 0 <= nbytes <= MAX_PAYLOAD_BYTES:
        raise PeerProtocolError(f"bulk size must be an integer in [0, {MAX_PAYLOAD_BYTES}]")
    if not isinstance(header, dict):
        raise PeerProtocolError("the kind's fields must be a JSON object")
    return Frame(kind, nbytes, header)


def encode_header(kind: str, nbytes: int, header: dict[str, Any]) -> bytes:
    raw = json.dumps({"k": kind, "n": nbytes, "h": header}, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, len(raw)) + raw


class Stream:
    """Frame I/O on a connected socket; every blocking call waits at most `budget()` seconds.

    `budget` may raise PeerTimeoutError itself (a caller's deadline that passed). Socket
    errors come out as PeerError subclasses naming `peer`.
    """

    def __init__(self, sock: socket.socket, peer: str, budget: Callable[[], float]) -> None:
        self.sock, self.peer, self.budget = sock, peer, budget

    def send(self, kind: str, header: dict[str, Any], payload: Sequence[Chunk] = ()) -> None:
        size = sum(c.nbytes for c in payload)
        head = encode_header(kind, size, header)
        if payload and size <= _INLINE and not any(isinstance(c, FileRegion) for c in payload):
            head, payload = b"".join([head, *payload]), ()
        try:
            self._sendall(memoryview(head))
            for chunk in payload:
                if isinstance(chunk, FileRegion):
                    self._sendfile(chunk)
                else:
                    self._sendall(chunk)
        except OSError as exc:
            raise self._error("sending to", exc) from None

    def recv(self) -> Frame | None:
        """The next frame's header, or None when the peer closed between frames."""
        prefix = bytearray(PREFIX.size)
        if not self.recv_into(memoryview(prefix), at_boundary=True):
            return None
        magic, length = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise PeerProtocolError(f"not an ftrun peer frame (starts with {bytes(prefix)!r})")
        if length > MAX_HEADER_BYTES:
            raise PeerProtocolError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
        raw = bytearray(length)
        self.recv_into(memoryview(raw))
        return parse_header(bytes(raw))

    def drain(self, nbytes: int) -> None:
        """Read and drop `nbytes` bulk bytes (a reply nobody reads, a payload nobody took)."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            step = min(nbytes, len(scratch))
            self.recv_into(scratch[:step])
            nbytes -= step

    def readable(self, timeout: float) -> bool:
        """True when bytes (or the end of the stream) arrive within `timeout` seconds."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(max(timeout, 0.0) * 1000))

    def close(self) -> None:
        self.sock.close()

    # ---- bounded socket calls ------------------------------------------------------------

    def _sendall(self, view: memoryview) -> None:
        for start in range(0, len(view), _CHUNK):
            self.sock.settimeout(self.budget())
            self.sock.sendall(view[start : start + _CHUNK])

    def _sendfile(self, region: FileRegion) -> None:
        offset, end = region.offset, region.offset + region.nbytes
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        while offset < end:
            self.sock.settimeout(self.budget())  # also makes the socket non-blocking
            try:
                sent = os.sendfile(self.sock.fileno(), region.fd, offset, min(end - offset, _CHUNK))
            except BlockingIOError:
                if not poller.poll(self.budget() * 1000):
                    raise TimeoutError("timed out") from None
                continue
            if sent == 0:
                raise OSError(f"file ended {end - offset} bytes before its region")
            offset += sent

    def recv_into(self, view: memoryview, at_boundary: bool = False) -> bool:
        """Fill `view` (a flat byte view) with the next bytes; False if the stream ended before
        its first byte and `at_boundary`."""
        got, want = 0, len(view)
        try:
            while got < want:
                self.sock.settimeout(self.budget())
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    if at_boundary and got == 0:
                        return False
                    raise PeerError(f"{self.peer} closed the connection in the middle of a frame")
                got += n
        except OSError as exc:
            raise self._error("receiving from", exc) from None
        return True

    def _error(self, doing: str, exc: OSError) -> PeerError:
        if isinstance(exc, TimeoutError):
            return PeerTimeoutError(f"timed out {doing} {self.peer}")
        return PeerError(f"connection to {self.peer} lost while {doing} it: {exc}")
