"""Closing the TCP connections the wrapped function opened: how a gloo collective is stopped.

`ProcessGroupGloo.abort()` does not return a collective blocked on a peer, and destroying the
group closes its sockets only once the last reference to it goes, which DistributedDataParallel
does not let happen (its construction leaves references to the group behind). A peer blocked on
this rank returns at once when this rank's sockets are shut down, so every rank, once its
iteration is over, shuts down the TCP connections opened while its function ran: gloo's pairs,
and stores the function made for this iteration. Connections that existed before (the wrapper's
own store, a store the user built outside the function) are left alone. An NCCL group is aborted
first (`AbortTorchDistributed`); shutting down its bootstrap sockets afterwards is harmless.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import NamedTuple

ESTABLISHED, LISTEN = "01", "0A"


class TcpSocket(NamedTuple):
    """A row of /proc/self/net/tcp or tcp6 (this process's network namespace)."""

    inode: int
    state: str
    port: int
    """The local port."""
    family: int
    local: str
    """The local address as /proc writes it (hex, 32-bit words in host order): `host()`."""

    def host(self) -> str:
        """The local address; a wildcard one as its loopback (where a connection reaches it)."""
        words = (self.local[i : i + 8] for i in range(0, len(self.local), 8))
        raw = b"".join(bytes.fromhex(word)[::-1] for word in words)
        text = socket.inet_ntop(self.family, raw)
        return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(text, text)


class FunctionSockets:
    """The TCP connections this process has that it did not have at `mark()`, except those a
    server listening since before accepted (a store the wrapper or the user served already)."""

    def __init__(self) -> None:
        self._before: set[int] = set()
        self._servers: set[int] = set()

    def mark(self) -> None:
        """The function starts: what is open now is not its to lose."""
        table = tcp_table()
        self._before = {row.inode for row in table if row.state == ESTABLISHED}
        self._servers = {row.port for row in table if row.state == LISTEN}

    def shut_down_new(self) -> int:
        """Shut down (both ways) every connection the function opened; how many."""
        mine = {row.inode for row in tcp_table()
                if row.state == ESTABLISHED and row.inode not in self._before
                and row.port not in self._servers}  # fmt: skip
        fds = own_socket_fds()
        count = 0
        for fd in (fds[inode] for inode in mine if inode in fds):
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:  # closed meanwhile, or not a socket any more
                continue
        return count


def own_socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> descriptor."""
    fds = {}
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(entry.name)
    return fds


def tcp_table() -> list[TcpSocket]:
    """Every TCP socket this process's network namespace has (the inodes tell this process's
    own apart: `own_socket_fds`)."""
    rows = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                local, port = fields[1].rsplit(":", 1)
                rows.append(TcpSocket(int(fields[9]), fields[3], int(port, 16), family, local))
    return rows
