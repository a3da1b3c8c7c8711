"""The agent's link to its wrapped ranks: where they coordinate, and interrupting them there.

A wrapped rank writes `<ipc-dir>/inprocess/coordination.json` (its store's address and key
prefix, and the cycle) when its wrapper starts. The agent interrupts the ranks' current restart
iteration by writing into that store what a failing rank would write (`ftrun.inprocess.
iteration`): every rank's watcher wakes, aborts and restarts. Each interruption the agent makes
is appended to `agent-interrupts` in the same directory (its time): the ladder counts them.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from pathlib import Path

from torch.distributed import PrefixStore, TCPStore

from ftrun.inprocess.events import COORDINATION_FILE, SUBDIR
from ftrun.inprocess.iteration import Interruption, Iteration, newest_iteration

log = logging.getLogger("ftrun.agent")

ATTEMPTS_FILE = "agent-interrupts"
_CONNECT_TIMEOUT = datetime.timedelta(seconds=2)
"""The agent loop waits this long at most for a store that is gone (then escalates)."""


class Coordination:
    """This node's view of its wrapped ranks (`ipc_dir`: the job's 0700 directory)."""

    def __init__(self, ipc_dir: Path) -> None:
        self.folder = ipc_dir / SUBDIR

    def current(self, cycle: int) -> dict[str, object] | None:
        """The coordination record of `cycle`'s wrapped ranks; None if they do not wrap."""
        try:
            record = json.loads((self.folder / COORDINATION_FILE).read_text())
        except (OSError, ValueError):
            return None
        fresh = isinstance(record, dict) and str(record.get("cycle")) == str(cycle)
        return record if fresh and record.get("address") else None

    def recent_attempts(self, window_s: float, now: float | None = None) -> int:
        now = time.time() if now is None else now
        try:
            stamps = [float(s) for s in (self.folder / ATTEMPTS_FILE).read_text().split()]
        except (OSError, ValueError):
            return 0
        return sum(1 for stamp in stamps if now - stamp <= window_s)

    def interrupt(self, cycle: int, ranks: tuple[int, ...], kind: str, why: str) -> bool:
        """End the wrapped ranks' current iteration; False if their store cannot be reached
        (the caller escalates)."""
        record = self.current(cycle)
        if record is None:
            return False
        host, _, port = str(record["address"]).rpartition(":")
        try:
            base = TCPStore(host, int(port), is_master=False, timeout=_CONNECT_TIMEOUT)
            store = PrefixStore(str(record["prefix"]), base)
            iteration = Iteration(store, newest_iteration(store), world_size=0)
            for rank in ranks:
                iteration.interrupt(Interruption(rank, kind, why, time.time()))
        except (RuntimeError, ValueError) as error:  # DistStoreError, a bad record
            log.warning("in-process: cannot reach the ranks' store at %s: %s", host, error)
            return False
        with (self.folder / ATTEMPTS_FILE).open("a") as out:
            out.write(f"{time.time()}\n")
        log.warning("in-process: %s: the wrapped ranks restart iteration %d", why,
                    iteration.number)  # fmt: skip
        return True
