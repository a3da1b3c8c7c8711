"""The agent-to-agent peer channel on 127.0.0.1: transfers, job binding, hostile peers, shutdown."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import hashlib
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from torch.distributed import TCPStore

from ftrun.peer import (
    FileRegion,
    PeerClient,
    PeerError,
    PeerHandshakeError,
    PeerProtocolError,
    PeerRemoteError,
    PeerServer,
    PeerTimeoutError,
    Reply,
    Request,
    auth,
    job_secret,
    protocol,
)
from ftrun.peer.protocol import MAGIC, MAX_HEADER_BYTES, Stream
from support import wait_for

HOST = "127.0.0.1"
SECRET = bytes(range(32))
JOB = "job-a"
BULK = 64 << 20
_BLOB = os.urandom(1 << 20) * (BULK >> 20)
_BLOB_SHA = hashlib.sha256(_BLOB).hexdigest()


def echo(request: Request) -> Reply:
    return Reply(
        {**request.header, "peer": request.peer}, request.read() if request.nbytes else None
    )


def sink(request: Request) -> dict[str, object]:
    """Receive a push straight into shared memory, as the checkpoint tier will."""
    with mmap.mmap(-1, request.nbytes) as memory:
        request.read_into(memory)
        return {"sha256": hashlib.sha256(memory).hexdigest()}


def fail(request: Request) -> None:
    raise ValueError("no such checkpoint")


def peer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ftrun-peer")]


@pytest.fixture
def server() -> Iterator[PeerServer]:
    with PeerServer(HOST, SECRET, JOB, handshake_timeout=5) as peer_server:
        peer_server.register("echo", echo)
        peer_server.register("blob", lambda r: Reply({"sha256": _BLOB_SHA}, memoryview(_BLOB)))
        peer_server.register("sink", sink)
        peer_server.register("fail", fail)
        peer_server.register("block", lambda r: Reply({}, memoryview(_BLOB)[: 1 << 20]))
        yield peer_server
    assert not peer_threads()


@pytest.fixture
def client() -> Iterator[PeerClient]:
    with PeerClient(SECRET, JOB) as peer_client:
        yield peer_client


def _sha(data: object) -> str:
    return hashlib.sha256(data).hexdigest()  # type: ignore[arg-type]


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The server's warnings that contain `text`, once there is one (its threads log them)."""

    def found() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "ftrun.peer" and r.levelno == logging.WARNING and text in r.getMessage()
        ]

    wait_for(found, timeout=5, what=f"a warning about {text!r}")
    time.sleep(0.05)  # time for a second one, which must not come
    return found()


def raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=5)
    sock.settimeout(5)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes (fails the test if it never does).

    Closing with our bytes unread makes the kernel reset the connection: that is closed too.
    """
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def fake_server(script: Callable[[Stream], None]) -> tuple[int, Callable[[], None]]:
    """A listener whose one connection runs `script` (an impostor, another version...)."""
    listener = socket.create_server((HOST, 0))

    def run() -> None:
        conn, address = listener.accept()
        with conn, contextlib.suppress(PeerError):
            script(Stream(conn, f"{address[0]}:{address[1]}", lambda: 5.0))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop() -> None:
        thread.join(10)
        listener.close()

    return listener.getsockname()[1], stop


# ---- transfers -------------------------------------------------------------------------------


def test_small_request_round_trips(server, client):
    header, payload = client.request(HOST, server.port, "echo", {"step": 7}, b"hello")
    assert header["step"] == 7 and payload == b"hello"
    header, payload = client.request(HOST, server.port, "echo", {"step": 8})
    assert header["step"] == 8 and payload is None


def test_bulk_fetch_into_shared_memory_and_push_from_it(server, client):
    with mmap.mmap(-1, BULK) as memory:
        header = client.fetch_into(HOST, server.port, "blob", {}, memory)
        assert header["sha256"] == _sha(memory) == _BLOB_SHA
        assert client.push(HOST, server.port, "sink", {}, memory) == {"sha256": _BLOB_SHA}


def test_a_payload_may_be_several_buffers_and_file_regions(server, client, tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(b"0123456789" * 1000)
    with path.open("rb") as file:
        parts = [b"head:", bytearray(b"mid:"), memoryview(b"xx"), FileRegion(file.fileno(), 10, 20)]
        _, payload = client.request(HOST, server.port, "echo", {}, parts)
    assert payload == b"head:mid:xx" + b"0123456789" * 2


def test_a_reply_may_be_sent_from_a_file_with_sendfile(client, tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(_BLOB[: 3 << 20])
    released = threading.Event()
    with path.open("rb") as file, PeerServer(HOST, SECRET, JOB) as peer_server:
        peer_server.register(
            "file", lambda r: Reply({}, FileRegion(file.fileno(), 0, 3 << 20), released.set)
        )
        dest = bytearray(3 << 20)
        client.fetch_into(HOST, peer_server.port, "file", {}, dest)
    assert dest == _BLOB[: 3 << 20] and released.is_set()


def test_a_reply_of_another_size_than_the_destination_is_refused(server, client):
    with pytest.raises(PeerProtocolError, match=f"replied with {BULK} bulk bytes, 10 were"):
        client.fetch_into(HOST, server.port, "blob", {}, bytearray(10))
    assert client.request(HOST, server.port, "echo", {"after": 1})[0]["after"] == 1


def test_a_handler_error_reaches_the_caller_and_the_connection_goes_on(server, client, caplog):
    first = client.request(HOST, server.port, "echo", {})[0]["peer"]
    with pytest.raises(PeerRemoteError, match="ValueError: no such checkpoint"):
        client.push(HOST, server.port, "fail", {}, b"x" * 100_000)  # the push is drained
    assert client.request(HOST, server.port, "echo", {})[0]["peer"] == first  # same connection
    assert len(warnings_about(caplog, "'fail' request")) == 1


def test_connections_are_reused_and_stale_ones_replaced(client):
    with PeerServer(HOST, SECRET, JOB, idle_timeout=0.2) as peer_server:
        peer_server.register("echo", echo)
        first = client.request(HOST, peer_server.port, "echo", {})[0]["peer"]
        assert client.request(HOST, peer_server.port, "echo", {})[0]["peer"] == first
        wait_for(lambda: peer_server.open_connections == 0, 10, "the idle connection closed")
        assert client.request(HOST, peer_server.port, "echo", {})[0]["peer"] != first


def test_concurrent_clients_are_served(server):
    shared = PeerClient(SECRET, JOB)

    def own_client(index: int) -> None:
        with PeerClient(SECRET, JOB) as own:
            for _ in range(20):
                data = os.urandom(1000 * (index + 1))
                header, payload = own.request(HOST, server.port, "echo", {"i": index}, data)
                assert (header["i"], payload) == (index, data)

    def shared_client(index: int) -> None:
        for _ in range(20):
            with mmap.mmap(-1, 1 << 20) as memory:
                shared.fetch_into(HOST, server.port, "block", {}, memory)
                assert memory[:] == _BLOB[: 1 << 20]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        done = [pool.submit(own_client, i) for i in range(8)]
        done += [pool.submit(shared_client, i) for i in range(4)]
        for future in done:
            future.result(timeout=60)
    shared.close()


# ---- job binding -----------------------------------------------------------------------------


def test_a_client_with_another_secret_is_refused(server, caplog):
    with (
        PeerClient(os.urandom(32), JOB) as stranger,
        pytest.raises(PeerHandshakeError, match="refused the connection: authentication"),
    ):
        stranger.request(HOST, server.port, "echo", {})
    assert len(warnings_about(caplog, "authentication failed")) == 1


def test_a_server_without_the_secret_is_refused_by_the_client():
    def impostor(stream: Stream) -> None:
        stream.recv()
        stream.send("challenge", {"proto": protocol.PROTOCOL_VERSION, "nonce": "ab" * 16})
        stream.recv()
        stream.send("welcome", {"mac": "00" * 32})  # cannot compute the right one

    port, stop = fake_server(impostor)
    with (
        PeerClient(SECRET, JOB) as peer_client,
        pytest.raises(PeerHandshakeError, match="failed to prove it is an agent of job"),
    ):
        peer_client.request(HOST, port, "echo", {})
    stop()


def test_a_client_of_another_job_is_refused_even_with_the_secret(server, caplog):
    with (
        PeerClient(SECRET, "job-b") as other_job,
        pytest.raises(PeerHandshakeError, match="the client is of job 'job-b'"),
    ):
        other_job.request(HOST, server.port, "echo", {})
    assert len(warnings_about(caplog, "job 'job-b'")) == 1


def test_another_protocol_version_is_refused_both_ways(server, caplog):
    with raw_connection(server.port) as sock:
        stream = Stream(sock, "server", lambda: 5.0)
        stream.send("hello", {"proto": 99, "job": JOB, "nonce": "ab" * 16})
        frame = stream.recv()
        assert frame is not None and frame.kind == "reject"
        assert "peer protocol version 99, this agent 1" in frame.header["error"]
        assert stream.recv() is None  # and closed
    assert len(warnings_about(caplog, "version 99")) == 1

    def newer(stream: Stream) -> None:
        stream.recv()
        stream.send("challenge", {"proto": 99, "nonce": "ab" * 16})

    port, stop = fake_server(newer)
    with (
        PeerClient(SECRET, JOB) as peer_client,
        pytest.raises(PeerHandshakeError, match="speaks peer protocol version 99"),
    ):
        peer_client.request(HOST, port, "echo", {})
    stop()


def test_the_job_secret_comes_from_the_store_and_is_the_same_for_every_agent():
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    agents = [
        TCPStore(HOST, store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        for _ in range(4)
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        secrets = set(pool.map(lambda s: job_secret(s, "ftrun/run1"), agents))
    assert len(secrets) == 1 and len(next(iter(secrets))) == auth.SECRET_BYTES
    assert job_secret(store, "ftrun/run2") not in secrets


# ---- hostile or broken peers -----------------------------------------------------------------

BAD_STARTS = {
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "oversized header": MAGIC + struct.pack(">I", MAX_HEADER_BYTES + 1),
    "huge header": MAGIC + struct.pack(">I", 0xFFFFFFFF),
    "not json": MAGIC + struct.pack(">I", 4) + b"\xff\xfe{]",
    "not a frame object": MAGIC + struct.pack(">I", 2) + b"[]",
    "negative size": MAGIC + struct.pack(">I", 27) + b'{"k":"hello","n":-1,"h":{}}',
    "deeply nested": MAGIC + struct.pack(">I", 60000) + b"[" * 60000,
    "not hello": MAGIC + struct.pack(">I", 26) + b'{"k":"echo","n":0,"h":{}}\n',
}


@pytest.mark.parametrize("garbage", list(BAD_STARTS.values()), ids=list(BAD_STARTS))
def test_garbage_closes_the_connection_and_the_server_serves_on(server, client, caplog, garbage):
    with raw_connection(server.port) as sock:
        address = "{}:{}".format(*sock.getsockname())
        sock.sendall(garbage)
        assert read_until_closed(sock) == b""  # no answer to garbage: closed
    assert len(warnings_about(caplog, address)) == 1
    assert client.request(HOST, server.port, "echo", {"next": 1})[0]["next"] == 1


@pytest.mark.parametrize(
    "garbage",
    [b"\x00" * 64, MAGIC + struct.pack(">I", 1 << 30), MAGIC + struct.pack(">I", 2) + b"{}"],
    ids=["zeros", "oversized header", "bad header"],
)
def test_a_trusted_connection_is_still_validated(server, client, caplog, garbage):
    with raw_connection(server.port) as sock:
        address = "{}:{}".format(*sock.getsockname())
        auth.client_handshake(Stream(sock, "server", lambda: 5.0), SECRET, JOB)
        sock.sendall(garbage)
        assert read_until_closed(sock) == b""
    assert len(warnings_about(caplog, address)) == 1
    assert client.request(HOST, server.port, "echo", {"next": 1})[0]["next"] == 1


def test_an_unknown_kind_is_refused_and_its_connection_closed(server, client, caplog):
    with pytest.raises(PeerRemoteError, match="unknown request kind 'nuke'"):
        client.request(HOST, server.port, "nuke", {})
    assert len(warnings_about(caplog, "unknown request kind 'nuke'")) == 1
    assert client.request(HOST, server.port, "echo", {"next": 1})[0]["next"] == 1


def test_a_peer_that_never_answers_costs_a_timeout_not_a_hang(client):
    listener = socket.create_server((HOST, 0))  # the kernel accepts; nobody ever answers
    started = time.monotonic()
    with pytest.raises(PeerTimeoutError):
        client.request(HOST, listener.getsockname()[1], "echo", {}, timeout=0.5)
    assert time.monotonic() - started < 1.5
    listener.close()


def test_a_handler_that_never_returns_costs_a_timeout(client):
    release = threading.Event()
    with PeerServer(HOST, SECRET, JOB) as peer_server:
        peer_server.register("stuck", lambda r: release.wait(10) and None)
        started = time.monotonic()
        with (
            pytest.raises(PeerTimeoutError, match=r"did not answer within 0\.5s|timed out"),
            mmap.mmap(-1, 4096) as memory,
        ):
            client.fetch_into(HOST, peer_server.port, "stuck", {}, memory, timeout=0.5)
        assert time.monotonic() - started < 1.5
        release.set()


def test_a_client_stalling_mid_frame_is_dropped(caplog):
    with PeerServer(HOST, SECRET, JOB, io_timeout=0.3) as peer_server:
        peer_server.register("sink", sink)
        with raw_connection(peer_server.port) as sock:
            address = "{}:{}".format(*sock.getsockname())
            auth.client_handshake(Stream(sock, "server", lambda: 5.0), SECRET, JOB)
            sock.sendall(protocol.encode_header("sink", 1000, {}) + b"x" * 10)  # then nothing
            assert read_until_closed(sock) == b""
    assert "timed out receiving" in warnings_about(caplog, address)[0]


def test_a_connection_that_never_says_hello_is_dropped(caplog):
    with PeerServer(HOST, SECRET, JOB, handshake_timeout=0.3) as peer_server:
        with raw_connection(peer_server.port) as sock:
            address = "{}:{}".format(*sock.getsockname())
            assert read_until_closed(sock) == b""
        assert "no handshake within 0.3s" in warnings_about(caplog, address)[0]


def test_connections_beyond_the_limit_are_refused(caplog):
    with PeerServer(HOST, SECRET, JOB, max_connections=1) as peer_server:
        peer_server.register("echo", echo)
        with PeerClient(SECRET, JOB) as first, PeerClient(SECRET, JOB) as second:
            first.request(HOST, peer_server.port, "echo", {})  # stays open in the pool
            with pytest.raises(PeerError):  # closed before or during the handshake
                second.request(HOST, peer_server.port, "echo", {})
            assert len(warnings_about(caplog, "1 connections open already")) == 1


def test_close_stops_every_thread_promptly(client):
    peer_server = PeerServer(HOST, SECRET, JOB).start()
    peer_server.register("echo", echo)
    client.request(HOST, peer_server.port, "echo", {})  # an idle pooled connection
    half_open = raw_connection(peer_server.port)  # a connection stuck in its handshake
    wait_for(lambda: len(peer_threads()) == 3, timeout=5, what="3 server threads")
    started = time.monotonic()
    peer_server.close()
    assert time.monotonic() - started < 1.0
    assert not peer_threads()
    assert read_until_closed(half_open) == b""
    half_open.close()
    with pytest.raises(PeerError, match="cannot connect"):
        client.request(HOST, peer_server.port, "echo", {}, timeout=2)


def test_reserved_and_duplicate_kinds_cannot_be_registered(server, client):
    for kind in ("hello", "reply", "echo", ""):
        with pytest.raises(ValueError, match="kind"):
            server.register(kind, echo)
    with pytest.raises(ValueError, match="reserved"):
        client.request(HOST, server.port, "auth", {})


def test_a_secret_too_short_to_bind_anything_is_refused():
    for make in (lambda: PeerClient(b"", JOB), lambda: PeerServer(HOST, b"short", JOB)):
        with pytest.raises(ValueError, match="at least 16 bytes"):
            make()
