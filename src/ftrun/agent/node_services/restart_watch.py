"""Learning, while the workers run, that another node ended the cycle: a wait, not a poll.

A node whose workers are fine learns that the job restarts from the cycle's restart key
(`control.request_restart` sets `c<c>/next`). The agent used to `check` it every
`--monitor-interval` (10 requests a second per agent: 10 N a second for the store, the largest
load on it at 1,000 nodes and more; docs/store.md). This service waits on the key instead, in a
thread with its own store client (a blocking wait holds its connection): on TCPStore the server
answers the moment the key is set, on etcd one watch does. The wait runs in chunks of
`CHUNK_S`, so that a stopped cycle's thread ends within one (on etcd, whose watch a stop ends
at once, `LONG_CHUNK_S`), and when the key appears it puts a `CycleEndedElsewhere` on the
agent's inbox. The agent keeps a slow `check` (`agent.node`) for a thread that lost its store.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable

from torch.distributed import Store

from ftrun.rendezvous.ranks import Round
from ftrun.services import NodeService, Post
from ftrun.store.ops import wait_for_key

log = logging.getLogger("ftrun.agent")

CHUNK_S = 1.0
"""One wait on the key: a store request a second per agent while training, and how long a
stopped cycle's thread may outlive it."""
LONG_CHUNK_S = 30.0
"""One wait on a store whose wait another thread can end (`EtcdStore.interrupt`): one watch
request per agent per half minute; a stop ends it at once."""
CONNECT_S = 2.0
"""The thread's own client's bound on a request (and on connecting): a store that is gone
keeps it no longer than that, so that `close` can join it."""


@dataclasses.dataclass(frozen=True)
class CycleEndedElsewhere:
    """The restart key of `cycle` is set (an inbox item)."""

    cycle: int


class RestartWatch(NodeService):
    name = "restart-watch"

    def __init__(
        self, connect: Callable[[], Store], restart_key: Callable[[int], str], post: Post
    ) -> None:
        """`connect`: a store client of the thread's own; `restart_key`: the key that ends a
        cycle (`JobControl.restart_key`). The thread only waits: it writes nothing (a store
        that restarted empty is the agent's to restore first)."""
        self._connect, self._restart_key, self._post = connect, restart_key, post
        self._threads: list[tuple[threading.Thread, threading.Event, list[Store]]] = []

    def on_started(self, rnd: Round, pids: Iterable[int]) -> None:
        self._stop_all()
        stop, clients = threading.Event(), []
        thread = threading.Thread(target=self._wait, args=(rnd.number, stop, clients),
                                  daemon=True, name=f"restart-watch-c{rnd.number}")  # fmt: skip
        self._threads = [entry for entry in self._threads if entry[0].is_alive()]
        self._threads.append((thread, stop, clients))
        thread.start()

    def on_stopped(self, rnd: Round | None, pids: Iterable[int]) -> None:
        self._stop_all()  # not joined: a restart does not wait for a chunk to end

    def on_finished(self, rnd: Round) -> None:
        self._stop_all()

    def close(self) -> None:
        """Stop and join every thread (bounded): none may sit in a store call while the
        interpreter shuts down."""
        self._stop_all()
        for thread, _, _ in self._threads:
            thread.join(CHUNK_S + CONNECT_S + 2.0)
        self._threads = []

    def _stop_all(self) -> None:
        for _, stop, clients in self._threads:
            stop.set()  # before the interrupt: a thread that connects after it sees the stop
            for client in clients:
                interrupt = getattr(client, "interrupt", None)
                if interrupt is not None:
                    interrupt()

    def _wait(self, cycle: int, stop: threading.Event, clients: list[Store]) -> None:
        """Wait on the key until it is set or `stop`; a store that fails (it restarts, or is
        lost: the agent's own client says so) is met again a chunk later, and meanwhile the
        agent's slow check still sees the key."""
        while not stop.is_set():
            try:
                store, key = self._connect(), self._restart_key(cycle)
                clients.append(store)
                chunk = LONG_CHUNK_S if hasattr(store, "interrupt") else CHUNK_S
                while not stop.is_set():
                    if wait_for_key(store, key, chunk):
                        if not stop.is_set():
                            self._post(CycleEndedElsewhere(cycle))
                        return
            except Exception as exc:
                log.debug("restart watch of cycle %d: %s; again in %gs", cycle, exc, CHUNK_S)
                stop.wait(CHUNK_S)
