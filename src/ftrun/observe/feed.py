"""The job's event streams in the rendezvous store, read by the group-rank-0 agent's status page.

With `--ft-status-port`, every agent copies the events it writes into the store, one key per
event, and keeps a record of its ranks' progress there (`live`); the page's reader fetches only
what is new since its last look. Keys, under the job's prefix (`JobControl.prefix`):

- `observe/nodes`: every node that ever wrote, one name per line (appended once per launcher);
- `observe/events/<node>/n`: how many events the node wrote; `observe/events/<node>/<i>`: the
  i-th (1-based), the same JSON line as in `events-<node>.jsonl`. One writer per stream: the
  node writes the event, then the count, so a reader never asks for a key that is not there;
- `observe/live/<node>`: `{"ts", "cycle", "progress": [[rank, iteration, age_s], ...]}`.

Nothing here can stop training: a store error is logged once and the next publish retries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed import Store

from ftrun.eventlog.reader import Event, parse_line

KEPT_LOCAL = frozenset({"rank_startup", "health_watch"})
"""Event kinds that stay in the node's file only (per-rank start-up splits, poll costs): the
page does not show them and they would multiply the store's keys by the ranks."""
EMPTY_LIVE = b'{"ts": 0, "cycle": 0, "progress": []}'
BATCH = 1000
"""Keys per store request when reading (see `FeedReader._get`)."""


def _base(prefix: str) -> str:
    return f"{prefix}/observe"


class FeedWriter:
    """One node's side: its events and its live progress, into the store."""

    def __init__(self, store: Store, prefix: str, node: str) -> None:
        self._store = store
        self._base = _base(prefix)
        self._node = node
        self._count_key = f"{self._base}/events/{node}/n"
        self._written = 0

    def register(self) -> None:
        """Start (or, after a relaunch on the same store, continue) this node's stream."""
        store = self._store
        if store.check([self._count_key]):
            self._written = int(store.get(self._count_key))
        else:
            store.set(self._count_key, b"0")
            store.set(f"{self._base}/live/{self._node}", EMPTY_LIVE)
        store.append(f"{self._base}/nodes", f"{self._node}\n".encode())

    def events(self, records: Iterable[Mapping[str, Any]]) -> None:
        written = self._written
        for record in records:
            if record.get("event") in KEPT_LOCAL:
                continue
            written += 1
            line = json.dumps(record, default=str).encode()
            self._store.set(f"{self._base}/events/{self._node}/{written}", line)
        if written != self._written:
            self._store.set(self._count_key, str(written).encode())
            self._written = written

    def live(self, record: Mapping[str, Any]) -> None:
        self._store.set(f"{self._base}/live/{self._node}", json.dumps(record).encode())


class FeedReader:
    """The page's side: every node's events so far (fetching only the new ones) and live records."""

    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._base = _base(prefix)
        self.events: dict[str, list[Event]] = {}
        self._read: dict[str, int] = {}
        """Per node, how many of its keys were read (valid events or not)."""
        self.skipped = 0
        """Lines that were not valid events (a bug, or another writer on these keys)."""

    def nodes(self) -> list[str]:
        key = f"{self._base}/nodes"
        if not self._store.check([key]):
            return []
        names = self._store.get(key).decode(errors="replace").split()
        return list(dict.fromkeys(names))  # a relaunched node appears twice: once is enough

    def read(self) -> tuple[dict[str, list[Event]], dict[str, dict[str, Any]]]:
        """(events by node, live record by node), both as of now; two or three store requests."""
        nodes = self.nodes()
        if not nodes:
            return self.events, {}
        counts = self._get([f"{self._base}/events/{n}/n" for n in nodes])
        wanted: list[tuple[str, str]] = []
        for node, raw in zip(nodes, counts, strict=True):
            have = self._read.setdefault(node, 0)
            self.events.setdefault(node, [])
            wanted += [
                (node, f"{self._base}/events/{node}/{i}") for i in range(have + 1, int(raw) + 1)
            ]
        lines = self._get([key for _, key in wanted])
        for (node, _), line in zip(wanted, lines, strict=True):
            self._read[node] += 1
            event = parse_line(line.decode(errors="replace"))
            if event is None:
                self.skipped += 1
            else:
                self.events[node].append(event)
        lives = self._get([f"{self._base}/live/{n}" for n in nodes])
        return self.events, {n: _live(raw) for n, raw in zip(nodes, lives, strict=True)}

    def _get(self, keys: list[str]) -> list[bytes]:
        """`multi_get` in requests of `BATCH` keys: torch's libuv store server answers one
        large request in superlinear time, and every other client of the store waits
        meanwhile (49,000 keys: 26 s in one request, 0.19 s in requests of 1,000)."""
        found: list[bytes] = []
        for start in range(0, len(keys), BATCH):
            found += self._store.multi_get(keys[start : start + BATCH])
        return found


def _live(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
