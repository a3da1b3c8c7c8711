"""Collecting flight-recorder dumps when a cycle ends in a hang, on every node, and naming the
collective a rank never entered (`agent.diagnosis.collectives`).

The protocol, for cycle N:
1. The node whose monitor judged ranks hung asks its own ranks to dump (before it kills them),
   and sets `c<N>/fr_request` in the store before it votes the restart.
2. Every node, when it stops its workers, sees the request (one `check`) and, unless it already
   did, asks its ranks to dump. It publishes their summaries under `c<N>/fr/<node>` (a few
   hundred bytes per rank: no trace leaves the node, only what the analysis needs).
3. The node that judged the hang, once its own workers are stopped, waits (bounded) for every
   node of the round, runs the analysis and writes a `collectives` event and a log line.

Each rank answers through the listener `ftrun.client_lib.flight` starts in it; the dumps stay in
the job's 0700 directory, and each rank's JSON is also kept with the cycle's logs. A stopped rank
(SIGSTOP, a debugger) is not asked: it never answers, and is left as one that did not dump.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from ftrun import untrusted_json
from ftrun.agent.decisions.collectives import RankCollectives, Stall, find_stalls, summarize
from ftrun.client_lib.flight import FR_DIR, fifo_path
from ftrun.rank_monitor.process_state import answers, is_stopped
from ftrun.rendezvous.control import JobControl
from ftrun.rendezvous.ranks import Round
from ftrun.services import Emit

log = logging.getLogger("ftrun.agent")

DUMP_TIMEOUT_S = 3.0
"""How long the ranks get to write their dumps (a hung rank's listener thread answers at once;
one whose main thread holds the GIL in C code may not answer at all)."""
GATHER_TIMEOUT_S = 5.0
"""How long the judging node waits for the other nodes' summaries: they come within the other
nodes' stop (a monitor interval to see the vote, and at most DUMP_TIMEOUT_S for their ranks);
a node that never answers (its agent is gone) costs the restart this much, once."""
_POLL_S = 0.01


class FlightRecorder:
    """One node's part in collecting the flight recorders of a cycle that hung."""

    def __init__(self, job_dir: Path, node_log_dir: Path, node: str, emit: Emit) -> None:
        self._job_dir, self._logs, self._node, self._emit = job_dir, node_log_dir, node, emit
        self._dumped: dict[int, list[RankCollectives]] = {}
        self._judged: set[int] = set()

    def on_hang(self, control: JobControl, cycle: int, workers: Sequence[tuple[int, int]]) -> None:
        """This node judged ranks hung: dump its ranks, then ask every node to (before the vote).
        `workers`: (rank, pid) of this node's workers."""
        self._judged.add(cycle)
        self._dump(cycle, workers)
        control.request_collectives(cycle)

    def before_stop(
        self, control: JobControl, cycle: int, workers: Sequence[tuple[int, int]]
    ) -> None:
        """The cycle ends: if it hung anywhere, dump (once) and publish this node's summaries."""
        if cycle not in self._dumped:
            if not control.collectives_requested(cycle):
                return
            self._dump(cycle, workers)
        summary = json.dumps([r.to_json() for r in self._dumped[cycle]])
        control.publish_collectives(cycle, self._node, summary)

    def after_stop(self, control: JobControl, rnd: Round) -> list[Stall]:
        """On the node that judged the hang: gather every node's summaries and name the stall."""
        cycle = rnd.number
        if cycle not in self._judged:
            return []
        self._judged.discard(cycle)
        nodes = [n.node for n in rnd.nodes]
        published = control.collectives(cycle, nodes, GATHER_TIMEOUT_S)
        dumps = [d for raw in published.values() for d in _parse(raw)]
        stalls = find_stalls(dumps, range(rnd.world_size))
        for stall in stalls:
            log.error("cycle %d hang, by the flight recorders: %s", cycle, stall.describe())
            self._emit("collectives", group=stall.group, seq=stall.seq, op=stall.op,
                       sizes=stall.sizes, last_completed=stall.last_completed,
                       entered=list(stall.entered), missing=list(stall.missing),
                       no_dump=list(stall.no_dump), nodes_answered=sorted(published),
                       suspects=suspect_nodes(rnd, stall), summary=stall.describe())  # fmt: skip
        if not stalls:
            log.warning("cycle %d hang: the flight recorders name no stalled collective (%d of "
                        "%d node(s) answered)", cycle, len(published), len(nodes))  # fmt: skip
        self._dumped.pop(cycle, None)
        return stalls

    def _dump(self, cycle: int, workers: Sequence[tuple[int, int]]) -> None:
        out = self._job_dir / FR_DIR
        asked: dict[int, tuple[int, Path]] = {}
        for rank, pid in workers:
            if is_stopped(pid):  # it would never answer: waiting would cost the whole timeout
                log.warning("rank %d (pid %d) is stopped: no flight-recorder dump", rank, pid)
                continue
            target = out / f"cycle{cycle}-rank{rank}.json"
            if _ask(fifo_path(self._job_dir, rank, pid), target):
                asked[rank] = (pid, target)
        _await_dumps(asked.values(), DUMP_TIMEOUT_S)
        found = []
        for rank, (_, target) in asked.items():
            try:
                raw = target.read_bytes()
            except OSError:
                continue
            if (summary := summarize(rank, raw)) is not None:
                found.append(summary)
            keep = self._logs / f"cycle{cycle}" / f"flight-rank{rank}.json"
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(target, keep)
        self._dumped[cycle] = found


def _await_dumps(asked: Iterable[tuple[int, Path]], timeout: float) -> None:
    """Wait (at most `timeout`) until each (pid, target) dumped or can no longer: a rank that
    died meanwhile (its collective's peer was killed, say) or was stopped never will."""
    deadline = time.monotonic() + timeout
    pending = list(asked)
    while pending and time.monotonic() < deadline:
        pending = [(pid, t) for pid, t in pending if not t.exists() and answers(pid)]
        if pending:
            time.sleep(_POLL_S)


def suspect_nodes(rnd: Round, stall: Stall) -> list[str]:
    """The nodes of the ranks that never entered the collective (or never dumped)."""
    suspects = set(stall.missing or stall.no_dump)
    found, first = [], 0
    for node in rnd.nodes:
        ranks = range(first, first + node.local_world_size)
        first += node.local_world_size
        if suspects.intersection(ranks):
            found.append(node.node)
    return found


def _ask(fifo: Path, target: Path) -> bool:
    """Tell a rank's listener where to dump; False if it has none (no client, no recorder)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody listens
        try:
            os.write(fd, f"{target}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def _parse(raw: str) -> list[RankCollectives]:
    try:
        items = untrusted_json.loads(raw)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [r for r in (RankCollectives.from_json(i) for i in items) if r is not None]
