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

_ESTABLISHED, _LISTEN = "01", "0A"


class FunctionSockets:
    """The TCP connections this process has that it did not have at `mark()`, except those a
    server listening since before accepted (a store the wrapper or the user served already)."""

    def __init__(self) -> None:
        self._before: set[int] = set()
        self._servers: set[int] = set()

    def mark(self) -> None:
        """The function starts: what is open now is not its to lose."""
        table = _tcp_table()
        self._before = {inode for inode, state, _ in table if state == _ESTABLISHED}
        self._servers = {port for _, state, port in table if state == _LISTEN}

    def shut_down_new(self) -> int:
        """Shut down (both ways) every connection the function opened; how many."""
        mine = {inode for inode, state, port in _tcp_table()
                if state == _ESTABLISHED and inode not in self._before
                and port not in self._servers}  # fmt: skip
        count = 0
        for fd in _fds_of(mine):
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:  # closed meanwhile, or not a socket any more
                continue
        return count


def _fds_of(inodes: set[int]) -> list[int]:
    fds = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in inodes:
            fds.append(int(entry.name))
    return fds


def _tcp_table() -> list[tuple[int, str, int]]:
    """(inode, state, local port) of every TCP socket this process's network namespace has
    (the inodes tell this process's own apart)."""
    rows = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                port = int(fields[1].rsplit(":", 1)[1], 16)
                rows.append((int(fields[9]), fields[3], port))
    return rows
