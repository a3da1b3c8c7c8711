"""Attribution: per failed cycle, what failed (its signature), the suspected node and rank, the
evidence, and what the restart policy decided.

Read from the launchers' events: `failure` (a named failure and the policy's decision, written
by the node it happened on), `node_lost` (a node that vanished with its workers, told by a
survivor at the next round), `health_finding`, `hang` (where the ranks were stuck) and
`collectives` (the collective a hung rank never entered). Failures marked `secondary` (a
peer or the store went away) are consequences: the cause is the primary failure of the cycle,
or the lost node. Re-run verdicts (`rerun_verdict`, from `ftrun.rerun`) are listed apart:
they diagnose a result, not a failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ftrun.eventlog.reader import Event, ints


@dataclasses.dataclass(frozen=True)
class Attribution:
    cycle: int
    signature: str
    """The failure's key (what the policy compares), or what was lost."""
    node: str
    rank: int | None
    evidence: tuple[str, ...]
    decision: str
    """'restart', 'exclude node', 'stop job' (with why), or 'restart (node lost)'."""


def attribute(events: Sequence[Event]) -> tuple[Attribution, ...]:
    """One attribution per cycle that has a named failure or a lost node, in cycle order."""
    failed = {e.cycle for e in events if e.event in ("failure", "collectives")}
    lost = {int(e.get("lost_cycle", -1)) for e in events if e.event == "node_lost"}
    found = (_cycle(cycle, events) for cycle in sorted(failed | lost))
    return tuple(one for one in found if one is not None)


def _cycle(cycle: int, events: Sequence[Event]) -> Attribution | None:
    named = [e for e in events if e.event == "failure" and e.cycle == cycle]
    primary = [e for e in named if not e.get("secondary")]
    lost = lost_nodes(events, cycle)
    consequences = tuple(f"then on {e.node}: {e.get('key')}" for e in named if e not in primary)
    hangs = [e for e in events if e.event == "hang" and e.cycle == cycle]
    culprit = hang_culprit(cycle, hangs, events)
    if primary:
        first = primary[0]
        evidence = (*_evidence(first, events), *consequences)
        decision = str(first.get("decision", "restart"))
        if first.get("reason"):
            decision += f": {first.get('reason')}"
        node, rank = first.node, first.get("rank")
        if culprit is not None and first.get("kind") == "hang":
            # Verdicts race (the waiting ranks miss their heartbeats too): the first one may
            # be a waiting rank's; the flight recorders saw whom they all waited for.
            node, rank = culprit.first()
        return Attribution(cycle, str(first.get("key")), node, rank, evidence, decision)
    if (stalled := stall_finding(cycle, events)) is not None:
        node, rank = culprit.first() if culprit else (str(stalled.get("suspects", ["?"])[0]), None)
        decision = str(named[0].get("decision", "restart")) if named else "restart"
        return Attribution(cycle, f"collective: {stalled.get('op')} not entered", node, rank,
                           (str(stalled.get("summary")), *consequences), decision)  # fmt: skip
    if lost:
        what = f"node lost: {', '.join(lost)} (launcher and workers gone)"
        return Attribution(cycle, what, lost[0], None, consequences, "restart without it")
    if named:
        first = named[0]
        return Attribution(cycle, str(first.get("key")), first.node, first.get("rank"),
                           ("a consequence of a failure that left no record",),
                           str(first.get("decision", "restart")))  # fmt: skip
    return None


def lost_nodes(events: Sequence[Event], cycle: int) -> list[str]:
    """Nodes lost in `cycle` (a survivor tells it with the next round's `node_lost`)."""
    return [n for e in events if e.event == "node_lost" and e.get("lost_cycle") == cycle
            for n in e.get("nodes", [])]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Culprit:
    """The rank(s) a hang's other ranks waited for, and what says so."""

    ranks: tuple[int, ...]
    placed: tuple[tuple[str, tuple[int, ...]], ...]
    """(node, its ranks among `ranks`), nodes in order."""
    why: str
    """What names them: the flight recorders' finding, or a stopped process."""

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node for node, _ in self.placed)

    def first(self) -> tuple[str, int]:
        """The first suspect: its node and rank."""
        node, ranks = self.placed[0]
        return node, ranks[0]


def stall_finding(cycle: int, events: Sequence[Event]) -> Event | None:
    """The flight recorders' finding for `cycle` that names ranks (a `collectives` event whose
    collective some ranks never entered, or never dumped for); None: no such finding."""
    return next((e for e in events if e.event == "collectives" and e.cycle == cycle
                 and (ints(e.get("missing")) or ints(e.get("no_dump")))), None)  # fmt: skip


def hang_culprit(cycle: int, hangs: Sequence[Event], events: Sequence[Event]) -> Culprit | None:
    """Whom the hung ranks of `cycle` (their `hangs` events) waited for, strongest evidence
    first: ranks the flight recorders saw never enter the stalled collective; ranks whose
    process was stopped (they can do nothing; the others miss their heartbeats waiting); ranks
    that sent the flight recorders no dump (stopped, or dead: killed as hung, or failed because
    a peer was). None if nothing says."""
    found = stall_finding(cycle, events)
    op = f"{found.get('op')} seq {found.get('seq')}" if found is not None else ""
    stopped = tuple(sorted({e.get("rank") for e in hangs if e.get("stopped") is True}))
    if found is not None and (missing := ints(found.get("missing"))):
        ranks, why = missing, f"never entered {op}, by the flight recorders"
    elif stopped:
        ranks, why = stopped, "process stopped"
    elif found is not None:
        ranks, why = ints(found.get("no_dump")), f"no flight-recorder dump; the others in {op}"
    else:
        return None
    placed = _rank_nodes(cycle, events) | {e.get("rank"): e.node for e in hangs}
    suspects = [str(n) for n in found.get("suspects") or ()] if found is not None else []
    on = tuple((n, rs) for n in dict.fromkeys(placed.values())
               if (rs := tuple(r for r in ranks if placed.get(r) == n)))  # fmt: skip
    unplaced = tuple(r for r in ranks if r not in placed)
    if unplaced:  # no event placed them: the finding's first suspect node
        on += (((suspects or ["?"])[0], unplaced),)
    return Culprit(ranks, on, why)


def _rank_nodes(cycle: int, events: Sequence[Event]) -> dict[object, str]:
    """rank -> node, from the cycle's `workers_started` events."""
    return {rank: e.node for e in events if e.event == "workers_started" and e.cycle == cycle
            for rank in e.get("ranks") or ()}  # fmt: skip


def _evidence(failure: Event, events: Sequence[Event]) -> tuple[str, ...]:
    lines = []
    if failure.get("message") and failure.get("kind") != "health":  # the finding says it
        lines.append(str(failure.get("message")))
    same = [e for e in events if e.cycle == failure.cycle and e.node == failure.node]
    for finding in (e for e in same if e.event == "health_finding"):
        lines.append(f"health: {finding.get('finding')} ({finding.get('reading', '')})")
    for hang in (e for e in same if e.event == "hang" and e.get("where")):
        lines.append(f"rank {hang.get('rank')} {hang.get('where')}")
    for found in (e for e in events if e.event == "collectives" and e.cycle == failure.cycle):
        lines.append(f"flight recorders: {found.get('summary')}")
    return tuple(dict.fromkeys(lines))


@dataclasses.dataclass(frozen=True)
class RerunVerdict:
    """A re-run state machine's diagnosis (`ftrun.rerun`), as one line of the report."""

    cycle: int
    iteration: int
    rank: int
    diagnostic: str
    message: str
    initial: str
    rerun: str
    suspect_node: str
    outcome: str


_OUTCOMES = {
    "transient_error": "training went on with the re-run's result",
    "persistent_error": "the suspect node was excluded; training went on elsewhere",
}


def rerun_verdicts(events: Sequence[Event]) -> tuple[RerunVerdict, ...]:
    found = []
    for e in (e for e in events if e.event == "rerun_verdict"):
        diagnostic = str(e.get("diagnostic"))
        outcome = _OUTCOMES.get(diagnostic, "")
        if diagnostic == "correct_result":
            outcome = "the job stopped (17)" if e.get("fatal") else "training went on"
        found.append(RerunVerdict(e.cycle, int(e.get("iteration", -1)), int(e.get("rank", -1)),
                                  diagnostic, str(e.get("message", "")), str(e.get("initial", "")),
                                  str(e.get("rerun", "")), str(e.get("suspect_node", "")),
                                  outcome))  # fmt: skip
    return tuple(found)
