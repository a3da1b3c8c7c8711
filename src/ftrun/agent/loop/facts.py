"""What the executor reads before it asks the policy: `Facts`, from this node, its round and,
for the events whose decision depends on them, the job's state in the store. Each store read
happens only for the events that need it (a restart vote, a failure, a re-run request)."""

from __future__ import annotations

import dataclasses

from ftrun.agent.decisions import policy as p
from ftrun.agent.decisions.observed import Outcome
from ftrun.agent.loop.runtime import AgentRuntime
from ftrun.config.rendezvous import RendezvousImpl
from ftrun.rendezvous.ranks import Round

# Events whose decision depends on the job's state in the store (shutdown, failure count).
_READS_JOB_STATE = (p.JoinReady, p.JoinFailed, p.CycleEnded)
# Failures, judged against the job's history of failures.
_READS_HISTORY = (p.WorkerEnded, p.HangsFound, p.HealthFound)


def read_facts(
    rt: AgentRuntime, event: p.AgentEvent, rnd: Round | None, after_stop: Outcome | None
) -> p.Facts:
    facts = p.Facts(
        node=rt.node, cycle=rnd.number if rnd else -1, round_size=len(rnd.nodes) if rnd else 0,
        max_nodes=rt.config.rendezvous.max_nodes, after_stop=after_stop,
        stalled_cycles=rnd.stalled_cycles if rnd else 0,
        progress_known=rnd.progress_known if rnd else False,
    )  # fmt: skip
    if isinstance(event, _READS_JOB_STATE):
        control = rt.control
        facts = dataclasses.replace(
            facts, shutdown=control.shutdown_requested(), failures=control.failures()
        )
    if rnd is None:
        return facts
    if isinstance(event, p.NeighbourGone):  # a node that finished may leave before this one
        facts = dataclasses.replace(facts, finished_nodes=rt.control.count(rnd.number, "succeeded"))
    if isinstance(event, p.CycleEnded):  # a re-run's end lets the ranks finish their save
        rerun = rt.control.restarted_for_rerun(rnd.number)
        facts = dataclasses.replace(facts, ended_for_rerun=rerun)
    lost = isinstance(event, p.WorkerEnded) and event.returncode != 0
    if lost or isinstance(event, p.HangsFound):  # may the wrapped ranks recover it?
        link = rt.inprocess
        facts = dataclasses.replace(facts, inprocess_wrapped=link.wrapped(),
                                    inprocess_spent=link.spent())  # fmt: skip
    if isinstance(event, p.WorkerEnded) and event.returncode in p.RERUN_CODES:
        facts = _rerun_facts(rt, rnd, facts)
    named = getattr(event, "signature", None) is not None  # a failure, not an exit 0
    if isinstance(event, _READS_HISTORY) and named:
        min_nodes = rt.config.rendezvous.min_nodes
        facts = dataclasses.replace(
            facts, history=rt.control.failure_history(), ranks=rnd.ranks_of(rt.node),
            can_lose_node=len(rnd.nodes) - 1 >= min_nodes
            or bool(rnd.standby) or rt.rendezvous.num_nodes_waiting(rnd.number) > 0,
        )  # fmt: skip
    return facts


def _rerun_facts(rt: AgentRuntime, rnd: Round, facts: p.Facts) -> p.Facts:
    """Who could re-run a step elsewhere, and how often the job restarted for it already."""
    # Only the barrier rendezvous lets a node step aside for a standby.
    if rt.config.rendezvous.impl is not RendezvousImpl.BARRIER:
        return facts
    control, cycle = rt.control, rnd.number
    # Standby nodes of this node's round: another node's vote may have moved the job on.
    waiting = rt.rendezvous.num_nodes_waiting(cycle)
    # Those that stepped aside for this cycle's re-run are its suspects until a verdict.
    suspects = frozenset() if control.rerun_settled(cycle) else control.stepped_aside(cycle)
    return dataclasses.replace(
        facts, standby_waiting=waiting, suspects_standing_by=len(suspects & set(rnd.standby)),
        rerun_restarts=control.rerun_restarts(cycle, p.RERUN_RESTARTS_IN_A_ROW),
    )  # fmt: skip
