"""Waking NCCL's proxy threads while an abort runs, so that it ends in milliseconds.

`ncclCommAbort` sets the communicator's abort flag, then joins the proxy's two threads, which
sleep in `poll(..., 500)` and look at their flags only when they wake:
- the UDS thread (it passes cuMem file descriptors between local ranks) leaves on the abort
  flag, but nothing wakes it;
- the service thread leaves once the proxy's `stop` is set (at the end of `ncclProxyStop`,
  after the peers' connections were closed: their closes woke it before `stop` was set), so it
  sleeps one more half second.
Measured on 4 x H200 (torch 2.11, NCCL 2.28.9): `ProcessGroupNCCL.abort()` took 0.52-0.55 s on
an idle communicator (`bench/restart/nccl_abort.py`), and 0.09-0.52 s inside a restart: about
half of a raise's whole in-process restart. Woken, 0.04 s.

While the backends' aborts run, `ProxyWaker` wakes them, every few milliseconds, only in this
process (each rank wakes its own):
- an empty datagram to each NCCL UDS socket this process bound (found in `/proc/net/unix` by
  its name, `/tmp/nccl-socket-<rank>-<hash>`, abstract or not, and by the inode of one of this
  process's descriptors), until the socket is gone (the thread closes it on its way out);
- then, once every UDS socket is gone (so every abort flag is set: an NCCL socket accepting
  without its flag set would wait for a real peer), a connection reset at once to each TCP
  socket this process listens on, until the aborts end. NCCL drops a connection without its
  magic and looks at its flags; gloo ignores one without a sequence number; a store server
  sees a client that went away. (NCCL names its threads only under NCCL_SET_THREAD_NAME=1,
  so the service thread cannot be told apart from the others: the aborts' end is the bound.)
A UDS thread woken before its flag is set reads an empty request, which NCCL refuses (an error
it logs and ignores, or a wait for the flag); either way its communicator is one being aborted.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from pathlib import Path

from ftrun.inprocess.sockets import LISTEN, own_socket_fds, tcp_table

log = logging.getLogger("ftrun.inprocess")

POKE_EVERY_S = 0.005
"""How often a socket still bound is woken (the flag is set within a millisecond or so of the
abort's start; a few wake-ups before it cost NCCL nothing)."""
_NAME = "nccl-socket-"
_UNIX_TABLE = "/proc/self/net/unix"


def own_uds_addresses() -> list[str]:
    """The addresses (abstract ones starting with NUL) of the NCCL UDS sockets this process
    has bound."""
    try:
        lines = Path(_UNIX_TABLE).read_text().splitlines()[1:]
    except OSError:
        return []
    named = [fields for fields in map(str.split, lines)
             if len(fields) >= 8 and fields[7].rpartition("/")[2].startswith(_NAME)]  # fmt: skip
    if not named:  # no NCCL socket in this network namespace (a gloo job): no fds to read
        return []
    mine = own_socket_fds()
    addresses = []
    for fields in named:
        inode, path = int(fields[6]), fields[7]
        if inode in mine:
            # The table writes each NUL of an abstract name as "@"; NCCL binds the whole
            # sun_path (its name, then NULs to 108 bytes), and all of those bytes are the name.
            addresses.append("\0" + path[1:].replace("@", "\0") if path.startswith("@") else path)
    return addresses


def own_tcp_listeners() -> list[tuple[int, str, int]]:
    """(family, host, port) of each TCP socket this process listens on; a wildcard address as
    its loopback."""
    mine = own_socket_fds()
    return [(row.family, row.host(), row.port) for row in tcp_table()
            if row.state == LISTEN and row.inode in mine]  # fmt: skip


class ProxyWaker:
    """`with ProxyWaker():` around the backends' aborts: wakes this process's NCCL proxy
    threads until they are gone or the block ends. Does nothing without NCCL (gloo, CPU)."""

    def __init__(self, every_s: float = POKE_EVERY_S, *, enabled: bool = True) -> None:
        self._every_s = every_s
        self._enabled = enabled
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.pokes = 0

    def __enter__(self) -> ProxyWaker:
        if self._enabled and (addresses := own_uds_addresses()):
            self._thread = threading.Thread(target=self._run, args=(addresses,),
                                            name="ftrun-abort nccl-wake", daemon=True)  # fmt: skip
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self, addresses: list[str]) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.setblocking(False)
            while addresses and not self._done.wait(self._every_s):
                addresses = [a for a in addresses if self._poke(sender, a)]
        listeners = own_tcp_listeners()
        while listeners and not self._done.wait(self._every_s):
            for family, host, port in listeners:
                self._reset_connection(family, host, port)
        log.debug("abort: %d wake-ups sent to NCCL's proxy threads", self.pokes)

    def _poke(self, sender: socket.socket, address: str) -> bool:
        """Whether the socket is still there to wake."""
        try:
            sender.sendto(b"", address)
        except BlockingIOError:  # its queue is full of earlier wake-ups: it is awake
            return True
        except OSError:  # gone: the thread closed it on its way out
            return False
        self.pokes += 1
        return True

    def _reset_connection(self, family: int, host: str, port: int) -> None:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.settimeout(0.05)
            try:
                sock.connect((host, port))
            except OSError:
                return
            self.pokes += 1
