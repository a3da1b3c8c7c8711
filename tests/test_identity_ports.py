"""The workers' MASTER_PORT pick (`ftrun.identity.free_port`): below the kernel's ephemeral
range, and the ports after it free too (scripts serve more stores at MASTER_PORT + 1, + 2)."""

from __future__ import annotations

import socket

from ftrun import identity


def test_the_pick_is_below_the_ephemeral_range_with_its_neighbours_free():
    low = identity._ephemeral_low()
    for _ in range(20):
        port = identity.free_port("127.0.0.1")
        assert port >= 1024 and port + identity.MASTER_PORT_SPAN - 1 < min(low, 32768)
        for taken in range(port, port + identity.MASTER_PORT_SPAN):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", taken))  # raises if it was not free


def test_a_port_whose_neighbour_listens_is_not_picked(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        picks = iter([busy - 2, busy + 1])  # the first has `busy` as its + 2
        monkeypatch.setattr(identity.random, "randrange", lambda *_: next(picks))
        assert identity.free_port("127.0.0.1") == busy + 1
