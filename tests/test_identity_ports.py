"""The workers' MASTER_PORT pick (`ftrun.identity.free_port`): below the kernel's ephemeral
range, and the ports after it free too (scripts serve more stores at MASTER_PORT + 1, + 2)."""

from __future__ import annotations

import socket

from ftrun import identity


def test_the_pick_is_below_the_ephemeral_range_with_its_neighbours_free():
    first, end = identity._outside_ephemeral()
    for _ in range(20):
        port = identity.free_port("127.0.0.1")
        assert first <= port and port + identity.MASTER_PORT_SPAN <= end
        for taken in range(port, port + identity.MASTER_PORT_SPAN):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", taken))  # raises if it was not free


def test_a_port_whose_neighbour_listens_is_not_picked(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        # The first pick has `busy` as its + 2; the others are free unless another process
        # of the suite holds one (it once held busy + 1).
        others = [busy + 1 + 7 * k for k in range(50)]
        picks = iter([busy - 2, *others])
        monkeypatch.setattr(identity.random, "randrange", lambda *_: next(picks))
        assert identity.free_port("127.0.0.1") in others


def test_a_range_that_leaves_no_room_below_picks_above_it(monkeypatch, tmp_path):
    ranges = {"1024 40000": (40001, 65536), "1500 65000": (1024, 65536),
              "32768 60999": (16384, 32768)}  # fmt: skip
    for text, expected in ranges.items():
        fake = tmp_path / "range"
        fake.write_text(text)
        real_path = identity.Path
        monkeypatch.setattr(identity, "Path", lambda _p, fake=fake: fake)
        assert identity._outside_ephemeral() == expected
        monkeypatch.setattr(identity, "Path", real_path)
