"""Failures that repeat: the part of the restart policy that learns from the job's history.

Pure: a failure's signature, the node it happened on, the ranks that node held and the job's
history of failures (`rendezvous.control.FailureRecord`) in, a `Judgement` out.
`policy.Policy` applies it to every failure of a running cycle.

- A failure that is the consequence of another (`Signature.secondary`) restarts as before; it
  is never recorded, so it neither counts nor breaks a run.
- Failures are counted by cycle: one incident per cycle, however many nodes failed the same
  way in it (a bad batch read by every rank, every rank waiting on one).
- The same signature in `max_same_failure` cycles in a row stops the job with
  `ExitCode.REPEATED_FAILURE`, from one node or from many: restarting does not cure it, and
  retrying only burns the allocation. "In a row" reads the history: a cycle whose recorded
  failures are all of another signature breaks the run; a cycle that recorded none (a scale-up,
  a lost node, only consequences of a failure elsewhere) neither counts nor breaks it. In a job
  that reports iterations (`send_heartbeat(iteration=...)`), the run starts again at a cycle
  that trained past the job's best iteration: the same transient fault hours of training apart
  is not a bug that restarts cannot get past.
- A node leaves (if a standby node or the elastic minimum lets the job go on without it) only
  on evidence against the node: it failed the same way in two cycles while holding ranks that
  do not overlap, alone both times (the other nodes, holding the ranks it held before, did not
  fail that way). A failure that stays with the same ranks may be the software's on those ranks
  (a bug on rank 0 fails whichever node holds rank 0), so twice on one node in the same place
  restarts, says so, and reaches the stop above if it goes on. Health findings exclude a node
  on their own (`policy`'s `exclude_now`).
- Anything else restarts as before.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from ftrun.agent.decisions.attribution import Signature
from ftrun.eventlog.failures import ranks_text
from ftrun.rendezvous.control import FailureRecord


class Decision(str, enum.Enum):
    RESTART = "restart"
    EXCLUDE = "exclude"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class Judgement:
    decision: Decision
    reason: str = ""
    """Why, for the log and the events (empty for a plain restart)."""


def judge(
    signature: Signature,
    node: str,
    cycle: int,
    history: Sequence[FailureRecord],
    max_same_failure: int,
    can_lose_node: bool,
    ranks: range = range(0),
    stalled: int | None = None,
) -> Judgement:
    """What to do about `signature` on `node` (holding `ranks`; empty: not known) in `cycle`,
    given the job's failures so far (`history`, which may already hold other nodes' failures of
    this cycle) and, for a job that reports iterations, how many cycles in a row just before
    this one made no progress (`stalled`; None: not known)."""
    if signature.secondary:
        return Judgement(Decision.RESTART)
    now = FailureRecord(cycle, node, signature.key, ranks)
    records = [r for r in history if r.cycle <= cycle] + [now]
    run = _run(now.key, cycle, records)
    if stalled is not None:
        # The run starts again at the last cycle that trained past the job's best iteration:
        # that one, the `stalled` ones after it, and this one.
        run = run[: stalled + 2]
    if 0 < max_same_failure <= len(run):
        nodes = sorted({r.node for r in records if r.key == now.key and r.cycle in run})
        where = f"{len(nodes)} node" + ("s" if len(nodes) > 1 else "")
        return Judgement(
            Decision.STOP,
            f"the same failure in {len(run)} cycles on {where} ({', '.join(nodes)}), in a row: "
            f"{now.key}. Restarting does not cure it: a fault of the software or the data, or "
            f"of a node no health check names (--ft-max-same-failure={max_same_failure})",
        )
    alone = _alone(now.key, records)
    before = _moved_with(now, records, alone)
    if before is not None:
        evidence = (
            f"node {node} failed the same way holding ranks {ranks_text(before.ranks)} in cycle "
            f"{before.cycle} and ranks {ranks_text(ranks)} in cycle {cycle}, alone both times: the "
            f"fault follows the node ({now.key})"
        )
        if can_lose_node:
            return Judgement(Decision.EXCLUDE, evidence)
        return Judgement(Decision.RESTART, f"{evidence}, but it stays: no standby node waits "
                                           "and the job is at its minimum size")  # fmt: skip
    if not can_lose_node:  # nowhere to go anyway: nothing to explain
        return Judgement(Decision.RESTART)
    return Judgement(Decision.RESTART, _same_place_note(now, records, alone, max_same_failure))


def _run(key: str, cycle: int, records: Sequence[FailureRecord]) -> list[int]:
    """The cycles in a row, newest first from `cycle`, whose failures include `key`: counting
    back through the cycles that recorded a failure, up to the first that recorded only others."""
    keys: dict[int, set[str]] = {}
    for record in records:
        keys.setdefault(record.cycle, set()).add(record.key)
    run = []
    for past in sorted((c for c in keys if c <= cycle), reverse=True):
        if key not in keys[past]:
            break
        run.append(past)
    return run


def _alone(key: str, records: Sequence[FailureRecord]) -> dict[int, str | None]:
    """For each cycle with a failure `key`: the one node that failed that way, None if several."""
    nodes: dict[int, set[str]] = {}
    for record in records:
        if record.key == key:
            nodes.setdefault(record.cycle, set()).add(record.node)
    return {cycle: next(iter(n)) if len(n) == 1 else None for cycle, n in nodes.items()}


def _moved_with(
    now: FailureRecord, records: Sequence[FailureRecord], alone: dict[int, str | None]
) -> FailureRecord | None:
    """The latest earlier failure of `now.node` like `now`, at ranks that do not overlap
    `now.ranks`, with the node alone to fail that way both times; None if there is none."""
    if not now.ranks or alone.get(now.cycle) != now.node:
        return None
    for record in reversed(records):
        if (
            record.node == now.node
            and record.key == now.key
            and record.cycle < now.cycle
            and record.ranks
            and alone.get(record.cycle) == now.node
            and not _overlap(record.ranks, now.ranks)
        ):
            return record
    return None


def _same_place_note(
    now: FailureRecord,
    records: Sequence[FailureRecord],
    alone: dict[int, str | None],
    max_same_failure: int,
) -> str:
    """Why a node that failed alone the same way as last time stays though the job could go on
    without it (empty when it did not)."""
    mine = [r for r in records if r.node == now.node and r.cycle < now.cycle]
    if not mine or mine[-1].key != now.key or alone.get(now.cycle) != now.node:
        return ""
    if alone.get(mine[-1].cycle) != now.node:
        return ""
    stop = f"; {max_same_failure} cycles in a row stop the job" if max_same_failure > 0 else ""
    return (
        f"node {now.node} failed the same way again ({now.key}) without moving to other ranks: "
        f"the node and the work on its ranks are not told apart, so it stays{stop}"
    )


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
