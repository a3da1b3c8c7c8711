"""Job binding: the job's secret (shared through the store) and the handshake that proves it.

Every agent of a job reads the same 32-byte secret from the store (`job_secret`); the first one
to ask creates it with a compare-and-set under `<prefix>/peer/secret`. Whoever can use the job's
store is in the job: the channel trusts exactly what the store already does.

The handshake, in `protocol` frames, nonces being 16 random bytes in hex:

    client -> hello      {proto, job, nonce: Nc}
    server -> challenge  {proto, nonce: Ns}                                or reject {error}
    client -> auth       {mac: HMAC-SHA256(secret, [client, proto, job, Nc, Ns])}
    server -> welcome    {mac: HMAC-SHA256(secret, [server, proto, job, Nc, Ns])}  or reject

The client proves itself first, so a server tells nothing to a caller without the secret; the
role inside the MAC keeps either side from replaying the other's proof, the nonces keep anyone
from replaying an old one. `hello` and `reject` keep their shape in every protocol version, so
peers of different versions refuse each other with a message saying so. After `welcome` the
stream is trusted (no per-message MACs; bulk payloads are checksummed by their users).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import string
from typing import TYPE_CHECKING, Any

from ftrun.peer import protocol
from ftrun.peer.protocol import PeerError, PeerHandshakeError, PeerProtocolError, Stream

if TYPE_CHECKING:
    from torch.distributed import Store

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
_SHOWN = 80  # characters of a peer-supplied value quoted in an error


def job_secret(store: Store, prefix: str, known: bytes | None = None) -> bytes:
    """The job's peer secret: created by the first agent that asks, the same for all.
    `known`: the secret this agent already has, written back into a store that restarted."""
    key = f"{prefix}/peer/secret"
    value = store.compare_set(key, "", known.hex() if known else secrets.token_hex(SECRET_BYTES))
    try:
        secret = bytes.fromhex(value.decode())
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise PeerError(f"store key {key} does not hold a {SECRET_BYTES}-byte hex secret")
    return secret


def check_secret(secret: bytes) -> bytes:
    """The job secret, refused if too short to bind anything (a configuration mistake)."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError("the peer channel needs a job secret of at least "
                         f"{MIN_SECRET_BYTES} bytes")  # fmt: skip
    return secret


def client_handshake(stream: Stream, secret: bytes, job_id: str) -> None:
    """Prove this side and check the server's proof; raises PeerError if either fails."""
    client_nonce = secrets.token_hex(NONCE_BYTES)
    version = protocol.PROTOCOL_VERSION
    stream.send("hello", {"proto": version, "job": job_id, "nonce": client_nonce})
    challenge = _expect(stream, "challenge")
    if challenge.get("proto") != version:
        theirs = _show(challenge.get("proto"))
        raise PeerHandshakeError(f"{stream.peer} speaks peer protocol version {theirs}, "
                                 f"this agent {version}")  # fmt: skip
    server_nonce = _nonce(challenge.get("nonce"))
    nonces = (client_nonce, server_nonce)
    stream.send("auth", {"mac": _mac(secret, "client", job_id, *nonces)})
    welcome = _expect(stream, "welcome")
    if not _same(welcome.get("mac"), _mac(secret, "server", job_id, *nonces)):
        raise PeerHandshakeError(f"{stream.peer} failed to prove it is an agent of job "
                                 f"{job_id!r} (another secret)")  # fmt: skip


def server_handshake(stream: Stream, secret: bytes, job_id: str) -> None:
    """Check the client's proof and give ours; a refusal is told to the client, then raised."""
    hello = _expect(stream, "hello")
    version = protocol.PROTOCOL_VERSION
    if hello.get("proto") != version:
        _refuse(stream, f"peer protocol version {_show(hello.get('proto'))}, this agent {version}")
    if hello.get("job") != job_id:
        _refuse(stream, f"the client is of job {_show(hello.get('job'))}, not this agent's")
    client_nonce = _nonce(hello.get("nonce"))
    server_nonce = secrets.token_hex(NONCE_BYTES)
    stream.send("challenge", {"proto": version, "nonce": server_nonce})
    auth = _expect(stream, "auth")
    nonces = (client_nonce, server_nonce)
    if not _same(auth.get("mac"), _mac(secret, "client", job_id, *nonces)):
        _refuse(stream, "authentication failed (the client has another job secret)")
    stream.send("welcome", {"mac": _mac(secret, "server", job_id, *nonces)})


def _expect(stream: Stream, kind: str) -> dict[str, Any]:
    frame = stream.recv()
    if frame is None:
        raise PeerHandshakeError(f"{stream.peer} closed the connection during the handshake")
    if frame.kind == "reject":
        error = frame.header.get("error")
        text = error[:200] if isinstance(error, str) else _show(error)
        raise PeerHandshakeError(f"{stream.peer} refused the connection: {text}")
    if frame.kind != kind or frame.nbytes:
        raise PeerProtocolError(f"expected {kind!r} in the handshake, got {_show(frame.kind)}")
    return frame.header


def _refuse(stream: Stream, reason: str) -> None:
    with contextlib.suppress(PeerError):  # it is going away anyway; the reason is raised
        stream.send("reject", {"error": reason})
    raise PeerHandshakeError(reason)


def _mac(secret: bytes, role: str, job_id: str, client_nonce: str, server_nonce: str) -> str:
    fields = ["ftrun-peer", role, protocol.PROTOCOL_VERSION, job_id, client_nonce, server_nonce]
    return hmac.new(secret, json.dumps(fields).encode(), hashlib.sha256).hexdigest()


def _same(received: object, expected: str) -> bool:
    return isinstance(received, str) and hmac.compare_digest(received.encode(), expected.encode())


def _nonce(value: object) -> str:
    if not (isinstance(value, str) and len(value) == 2 * NONCE_BYTES
            and set(value) <= set(string.hexdigits)):  # fmt: skip
        raise PeerProtocolError("the handshake nonce is not 16 bytes in hex")
    return value


def _show(value: object) -> str:
    """A peer-supplied value for an error or log line: quoted, one line, bounded."""
    return repr(value)[:_SHOWN]
