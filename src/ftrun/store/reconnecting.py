"""A client of the job's store that comes through a restart of that store (`ftrun store`).

With `--ft-store-reconnect-timeout S` the store runs as its own process, off the agents (under
Slurm, a step of its own on the batch host). When the connection drops, every call that finds
it gone waits while one of them reconnects, for up to S seconds in all:

- a store that answers with the epoch mark this client saw is the same store (the network
  blinked): the call is made again, and nothing else happens;
- a store without it, or with another one, was restarted and has lost the job's keys: every
  call raises `StoreRestartedError` until the agent has written back what it knows
  (`rebuild`), and the agent then restarts the cycle in a fresh round;
- no store within S seconds (or the launcher got a signal meanwhile: preemption does not wait
  for the store): the call raises the connection error, as a plain TCPStore does (the agent
  ends with "store lost"), and so does every later call, at once.

One lock orders the reconnects of the agent's threads: a thread that failed on a connection
another thread has replaced since makes its call again on the new one.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
from collections.abc import Callable
from typing import TypeVar

from torch.distributed import DistError, DistNetworkError, Store

from ftrun.store.ops import get_if_exists

log = logging.getLogger("ftrun.rendezvous")

EPOCH_KEY = "ftrun-store/epoch"
"""Written once into a store that has none: a store without this client's value lost its keys."""
T = TypeVar("T")
Connect = Callable[[float], Store]
"""A new client of the store, trying for up to the given seconds; raises if none answers."""


class StoreRestartedError(DistError):
    """The store restarted empty; calls fail until `ReconnectingStore.rebuild` has run."""

    def __init__(self, store: ReconnectingStore) -> None:
        super().__init__("the rendezvous store restarted and lost the job's keys")
        self.store = store


class ReconnectingStore(Store):
    """torch's Store interface, forwarded to a client that is replaced when its store goes."""

    def __init__(self, client: Store, connect: Connect, window: float, where: str) -> None:
        super().__init__()
        self.set_timeout(client.timeout)
        self._client = client
        self._connect = connect
        self._window = window
        self._where = where
        self._lock = threading.Lock()
        self._generation = 0
        self._restarted = False
        self._gone: str | None = None
        """Why the store did not come back: every later call fails at once (the agent is
        leaving; its goodbyes must not each wait out the window again)."""
        self._rebuilder: int | None = None
        """The thread running `rebuild`: the only one whose calls go through meanwhile."""
        self._epoch = self._mark(client)

    # ---- the Store interface ------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._do(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        return self._do(lambda s: s.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._do(lambda s: s.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._do(lambda s: s.multi_set(keys, values))

    def check(self, keys: list[str]) -> bool:
        return self._do(lambda s: s.check(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._do(lambda s: s.wait(keys) if timeout is None else s.wait(keys, timeout))

    def add(self, key: str, amount: int) -> int:
        return self._do(lambda s: s.add(key, amount))

    def append(self, key: str, value: str | bytes) -> None:
        self._do(lambda s: s.append(key, value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._do(lambda s: s.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return self._do(lambda s: s.delete_key(key))

    def num_keys(self) -> int:
        return self._do(lambda s: s.num_keys())

    # ---- coming through a restart -------------------------------------------------------------

    def rebuild(self, restore: Callable[[], None]) -> None:
        """Run `restore` (this agent writing back what it knows, through this store), then take
        the store's new epoch: calls of every thread go through again."""
        with self._lock:
            self._rebuilder = threading.get_ident()
        try:
            restore()
            self._epoch = self._mark(self._client)
        finally:
            with self._lock:
                self._rebuilder = None
        self._restarted = False
        log.info("wrote this node's view of the job into the restarted store")

    def _do(self, call: Callable[[Store], T]) -> T:
        while True:
            with self._lock:
                if self._gone is not None:
                    raise DistNetworkError(self._gone)
                if self._restarted and self._rebuilder != threading.get_ident():
                    raise StoreRestartedError(self)
                client, generation = self._client, self._generation
            try:
                return call(client)
            except DistNetworkError as exc:
                self._reconnect(generation, exc)

    def _reconnect(self, generation: int, lost: DistNetworkError) -> None:
        """Replace the client (unless another thread did since `generation`), or raise `lost`."""
        with self._lock:
            if generation != self._generation:
                return
            first = (str(lost).strip().splitlines() or [repr(lost)])[0]
            log.warning("lost the rendezvous store at %s (%s); reconnecting for up to %gs",
                        self._where, first, self._window)  # fmt: skip
            try:
                client = self._connect(self._window)
                epoch = get_if_exists(client, EPOCH_KEY)
            except (RuntimeError, TimeoutError, ValueError) as exc:
                log.error("the rendezvous store at %s did not come back: %s", self._where, exc)
                self._gone = f"{first} (and no store again: {exc})"
                raise lost from None
            self._client, self._generation = client, generation + 1
            if epoch == self._epoch:
                log.info("the rendezvous store at %s answers again, with the job's keys",
                         self._where)  # fmt: skip
                return
            self._restarted = True
            log.warning("the rendezvous store at %s restarted and lost the job's keys: this "
                        "node writes back what it knows and the job restarts its cycle",
                        self._where)  # fmt: skip

    @staticmethod
    def _mark(client: Store) -> bytes:
        """The store's epoch: this client's token if it has none yet, else the one in force."""
        return client.compare_set(EPOCH_KEY, "", secrets.token_hex(8))
