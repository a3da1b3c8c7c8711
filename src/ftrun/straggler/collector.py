"""The agents' side of the scores, as plain objects fed by their owner (no threads, no store).

- `NodeCollector` (every node): the timing batches of the node's ranks over one interval,
  closed into one record per rank with its individual scores (the history lives here, where
  the rank's durations arrive, and survives a change of the reporting node).
- `Leader` (the node of group rank 0): keeps the records of every node that are new since its
  last report, so that a node that stopped publishing is not reported from stale data.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ftrun.rank_monitor.timings import TimingBatch
from ftrun.straggler.assemble import Columns, RankRecord, rank_record
from ftrun.straggler.scores import History


class NodeCollector:
    """One node's ranks, interval by interval."""

    def __init__(self, node: str, history: int = 16) -> None:
        self.node = node
        self.history = History(length=history)
        self.seq = 0
        self._durations: dict[int, dict[tuple[str, bool], list[int]]] = {}

    def add(self, batch: TimingBatch) -> None:
        mine = self._durations.setdefault(batch.rank, {})
        for section in batch.sections:
            mine.setdefault((section.name, section.gpu), []).extend(section.durations)

    def close_interval(self) -> dict[int, RankRecord] | None:
        """Every rank's record of the interval that ends now; None if no rank sent timings."""
        durations, self._durations = self._durations, {}
        if not durations:
            return None
        self.seq += 1
        return {
            rank: rank_record(rank, self.node, by_section, self.history)
            for rank, by_section in sorted(durations.items())
        }

    def new_cycle(self) -> None:
        """Ranks are other processes (maybe on other nodes) in a new cycle: start afresh."""
        self._durations.clear()
        self.history.forget()


class Leader:
    """The reporting node's view of the other nodes' records.

    The first report of a cycle waits (at most `patience` intervals) until every node of the
    round published: a report of half the job would compare half the ranks. A node whose
    workers time nothing never publishes; after that wait the others are reported without it.
    """

    def __init__(self, patience: int = 3) -> None:
        self.patience = patience
        self._used: dict[str, int] = {}
        self._waited = 0
        self.seq = 0

    def fresh(
        self, records: Mapping[str, tuple[int, Columns]], expected: Collection[str] = ()
    ) -> list[Columns] | None:
        """The nodes whose record is newer than the last one used; None if none
        (or while waiting for the round's other nodes)."""
        if not self._used and set(expected) - set(records) and self._waited < self.patience:
            self._waited += 1
            return None
        merged: list[Columns] = []
        for node, (seq, cols) in records.items():
            if seq > self._used.get(node, 0):
                self._used[node] = seq
                merged.append(cols)
        if not merged:
            return None
        self.seq += 1
        return merged

    def new_cycle(self) -> None:
        self._used.clear()
        self._waited = 0
        self.seq = 0
