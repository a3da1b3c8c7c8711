"""Suite-wide fixtures: every process a test starts must be gone when it ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil
import pytest

from support import become_subreaper, live_descendants, reap_zombies, wait_for

become_subreaper()
# c10d reverse-resolves the address of every socket it connects or accepts; where the resolver
# drops queries (this VM), each drop stalls that connect by glibc's default 5 s. Set before any
# lookup in this process, and inherited by the launchers and workers the tests start (as
# bench/rendezvous_scale.py does for itself).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = {p.pid for p in live_descendants()}
    yield
    reap_zombies()

    def leftovers() -> list[psutil.Process]:
        reap_zombies()
        return [p for p in live_descendants() if p.pid not in before]

    try:
        wait_for(lambda: not leftovers(), timeout=10, what="test processes to exit")
    except AssertionError:
        stray = leftovers()
        names = [f"{p.pid}:{' '.join(p.cmdline())[:80]}" for p in stray]
        for proc in stray:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        reap_zombies()
        pytest.fail(f"processes left behind: {names}")
