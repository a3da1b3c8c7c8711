"""Waking NCCL's UDS service threads while an abort runs, so that it ends in milliseconds.

`ncclCommAbort` sets the communicator's abort flag, then joins the proxy's threads. The proxy's
UDS thread (the one that passes cuMem file descriptors between local ranks) sleeps in
`poll(..., 500)` on its datagram socket and looks at the flag only when it wakes, and nothing
wakes it on an abort: the join waits for the end of its current half second. Measured on 4 x
H200 (torch 2.11, NCCL 2.27): `ProcessGroupNCCL.abort()` took 0.09-0.52 s, the same on every
rank of a job (their threads were started together at the communicator's creation), about half
of a raise's whole in-process restart.

While the backends' aborts run, `UdsWaker` sends an empty datagram every few milliseconds to
each NCCL UDS socket *this process* bound (found in `/proc/net/unix` by its name,
`/tmp/nccl-socket-<rank>-<hash>`, abstract or not, and by the inode of one of this process's
descriptors), until the socket is gone (the thread closes it on its way out) or the aborts end.
A woken thread that sees the flag leaves without reading the datagram. One that wakes before
the flag is set reads an empty request, which NCCL refuses (an error it logs and ignores, or a
wait for the flag); either way the communicator is the one being aborted. Other processes'
sockets are never written to: each rank wakes its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

log = logging.getLogger("ftrun.inprocess")

POKE_EVERY_S = 0.005
"""How often a socket still bound is woken (the flag is set within a millisecond or so of the
abort's start; a few wake-ups before it cost NCCL nothing)."""
_NAME = "nccl-socket-"
_UNIX_TABLE = "/proc/self/net/unix"


def own_uds_addresses() -> list[str]:
    """The addresses (abstract ones starting with NUL) of the NCCL UDS sockets this process
    has bound."""
    mine = _own_socket_inodes()
    addresses = []
    try:
        lines = Path(_UNIX_TABLE).read_text().splitlines()[1:]
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not fields[7].rpartition("/")[2].startswith(_NAME):
            continue
        if int(fields[6]) in mine:
            path = fields[7]
            addresses.append("\0" + path[1:] if path.startswith("@") else path)
    return addresses


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


class UdsWaker:
    """`with UdsWaker():` around the backends' aborts: wakes this process's NCCL UDS threads
    until they are gone or the block ends. Does nothing where there are none (gloo, CPU)."""

    def __init__(self, every_s: float = POKE_EVERY_S) -> None:
        self._every_s = every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.pokes = 0

    def __enter__(self) -> UdsWaker:
        addresses = own_uds_addresses()
        if addresses:
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
        log.debug("abort: %d wake-ups sent to NCCL's UDS threads", self.pokes)

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
