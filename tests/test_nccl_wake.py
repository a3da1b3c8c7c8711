"""The abort's wake-ups to NCCL's UDS threads: found by name among this process's sockets only,
and a thread that sleeps as NCCL's does (poll 500 ms, then look at the abort flag) leaves within
milliseconds of the flag instead of at the end of its half second."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from ftrun.inprocess import nccl_wake
from ftrun.inprocess.nccl_wake import (
    ProxyWaker,
    own_tcp_listeners,
    own_uds_addresses,
)
from support import wait_for


def bound(abstract: bool) -> tuple[socket.socket, str]:
    """A datagram socket named as NCCL names its own: abstract, NCCL puts a NUL over the
    path's leading "/" and binds the whole sun_path, so the name ends in NULs to 108 bytes."""
    name = f"/tmp/nccl-socket-1-{uuid.uuid4().hex[:12]}"
    address = ("\0" + name[1:]).ljust(108, "\0") if abstract else name
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    return sock, address


class NcclUdsThread:
    """NCCL's `ncclProxyServiceUDS` loop: poll 500 ms; if the abort flag is set, close and
    leave without reading; else read what came."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.abort_flag = threading.Event()
        self.left_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while True:
            events = poller.poll(500)
            if self.abort_flag.is_set():
                break
            if events:
                self.sock.recv(64)
        self.sock.close()
        self.left_at = time.monotonic()


def test_only_this_processes_nccl_sockets_are_found_abstract_or_not() -> None:
    abstract, abstract_address = bound(abstract=True)
    named, named_address = bound(abstract=False)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    other.bind(f"\0/tmp/not-nccl-{uuid.uuid4().hex[:8]}")
    theirs_name = f"/tmp/nccl-socket-2-{uuid.uuid4().hex[:12]}"
    script = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
        f"s.bind('\\0{theirs_name[1:]}'); print('up', flush=True); sys.stdin.read()"
    )
    theirs = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert theirs.stdout is not None and theirs.stdout.readline().strip() == "up"
        found = own_uds_addresses()
        assert abstract_address in found and named_address in found
        assert not any(theirs_name[1:] in a for a in found)  # another process's: never written to
        assert len([a for a in found if "nccl-socket-" in a]) == len(found)
    finally:
        theirs.communicate("", timeout=10)
        for sock in (abstract, named, other):
            sock.close()
        os.unlink(named_address)
    assert theirs.returncode == 0


def test_a_sleeping_uds_thread_leaves_within_milliseconds_of_the_flag() -> None:
    sock, _ = bound(abstract=True)
    uds = NcclUdsThread(sock)
    time.sleep(0.05)  # let it enter its half-second poll (the case the waker is for)
    with ProxyWaker() as waker:
        flagged = time.monotonic()
        uds.abort_flag.set()  # ncclCommAbort's first step
        uds.thread.join(1.0)
    assert uds.left_at is not None
    assert uds.left_at - flagged < 0.2, uds.left_at - flagged  # not up to 0.5 s
    assert waker.pokes >= 1


def quiet(waker: ProxyWaker) -> bool:
    """No wake-up in 25 of the waker's periods (a loaded machine may still be in a scan that
    saw the socket when it went: the first look that finds it quiet counts)."""
    before = waker.pokes
    time.sleep(0.05)
    return waker.pokes == before


def test_the_waker_stops_once_the_socket_is_gone_and_does_nothing_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its second phase resets this process's TCP listeners until the block ends: a pytest
    # worker may hold some from earlier tests (the suite's runs 50-51 did); this test is the
    # UDS phase's.
    monkeypatch.setattr(nccl_wake, "own_tcp_listeners", list)
    with ProxyWaker() as idle:
        time.sleep(0.02)
    assert idle.pokes == 0  # no NCCL socket in this process: no thread, nothing sent
    sock, _ = bound(abstract=True)
    uds = NcclUdsThread(sock)
    with ProxyWaker(every_s=0.002) as waker:
        uds.abort_flag.set()
        uds.thread.join(1.0)
        wait_for(lambda: quiet(waker), 10, "the wake-ups to stop once the socket is gone")
    assert not any(t.name == "ftrun-abort nccl-wake" for t in threading.enumerate())


class NcclServiceThread:
    """NCCL's `ncclProxyService` loop under an abort: poll 500 ms on its listening socket;
    leave once the proxy's `stop` is set (after the peers' closes had woken it); a connection
    without NCCL's magic is dropped."""

    def __init__(self, family: int) -> None:
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        self.listener.listen()
        self.stop = threading.Event()
        self.left_at: float | None = None
        self.accepted = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        while not self.stop.is_set():
            if poller.poll(500):
                with contextlib.suppress(OSError):
                    self.listener.accept()[0].close()
                    self.accepted += 1
        self.listener.close()
        self.left_at = time.monotonic()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_service_thread_waiting_for_stop_is_woken_once_the_uds_threads_are_gone(
    family: int,
) -> None:
    uds_sock, _ = bound(abstract=True)
    uds = NcclUdsThread(uds_sock)
    service = NcclServiceThread(family)
    port = service.listener.getsockname()[1]
    assert any(p == port and f == family for f, _, p in own_tcp_listeners())
    time.sleep(0.05)
    with ProxyWaker() as waker:
        uds.abort_flag.set()
        time.sleep(0.05)  # ncclProxyStop's work, then its last step
        stopped = time.monotonic()
        service.stop.set()
        service.thread.join(1.0)
        uds.thread.join(1.0)
    assert service.left_at is not None and service.left_at - stopped < 0.2  # not up to 0.35 s
    assert waker.pokes >= 2 and service.accepted >= 1


def test_the_service_thread_is_never_woken_while_a_uds_socket_is_left() -> None:
    """A UDS socket still bound: some communicator's abort flag may not be set, and an NCCL
    socket accepting without its flag waits for a real peer."""
    uds_sock, _ = bound(abstract=True)
    service = NcclServiceThread(socket.AF_INET)
    with ProxyWaker(every_s=0.002) as waker:
        time.sleep(0.1)
    service.stop.set()
    service.thread.join(1.0)
    uds_sock.close()
    assert waker.pokes >= 3  # the UDS socket, again and again
    assert service.accepted == 0
