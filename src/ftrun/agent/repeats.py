"""Failures that repeat: the part of the restart policy that learns from the job's history.

Pure: a failure's signature, the node it happened on and the job's history of failures in, a
`Judgement` out. `policy.Policy` applies it to every failure of a running cycle.

- A failure that is the consequence of another (`Signature.secondary`) restarts as before and
  is not counted.
- Failures are counted as incidents: one per cycle, however many nodes failed the same way in
  it (a bad batch read by every rank, every rank waiting on one).
- The same signature in `max_same_failure` cycles, on as many different nodes, stops the job
  with `ExitCode.REPEATED_FAILURE`: a fault that follows the work from node to node is the
  software's or the data's, and restarting only burns the allocation.
- A node whose previous failure had the same signature leaves, if a standby node or the elastic
  minimum lets the job go on without it, when both times it was the only node that failed that
  way (a fault shared by several nodes at once is not one node's). Otherwise it restarts, and
  says why the node stayed.
- Anything else restarts as before.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from ftrun.agent.attribution import Signature
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
) -> Judgement:
    """What to do about `signature` on `node` in `cycle`, given the job's failures so far
    (`history`, which may already hold other nodes' failures of this cycle)."""
    if signature.secondary:
        return Judgement(Decision.RESTART)
    key = signature.key
    incidents: dict[int, set[str]] = {}
    for record in history:
        if record.key == key:
            incidents.setdefault(record.cycle, set()).add(record.node)
    incidents.setdefault(cycle, set()).add(node)
    nodes = sorted(set().union(*incidents.values()))
    if 0 < max_same_failure <= min(len(incidents), len(nodes)):
        return Judgement(
            Decision.STOP,
            f"the same failure in {len(incidents)} cycles on {len(nodes)} nodes "
            f"({', '.join(nodes)}): {key}. It follows the work, not a node: a fault of the "
            f"software or the data (--ft-max-same-failure={max_same_failure})",
        )
    earlier = [r for r in history if r.node == node and r.cycle < cycle]
    if not earlier or earlier[-1].key != key:
        return Judgement(Decision.RESTART)
    if incidents[earlier[-1].cycle] != {node} or incidents[cycle] != {node}:
        return Judgement(Decision.RESTART)  # other nodes failed the same way: not this node's
    if can_lose_node:
        return Judgement(Decision.EXCLUDE, f"node {node} failed the same way twice: {key}")
    return Judgement(
        Decision.RESTART,
        f"node {node} failed the same way twice ({key}) but stays: no standby node waits "
        "and the job is at its minimum size",
    )
